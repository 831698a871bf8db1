"""Forward / backward of one megatron-core model over micro-batches, for any TP x PP x DP.

Every rank holds the same micro-batches as its TP and PP peers (SPMD); megatron-core's pipeline
schedule (`get_forward_backward_func`, also used at PP=1) moves activations between stages, and
what the last stage computes is broadcast to the other stages so every rank sees the results.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from hybridrl.models.forward import pipeline_forward
from hybridrl.parallel.distributed import ParallelGroups


def split_micro_batches(batch: Dict[str, torch.Tensor], micro_size: int) -> List[Dict[str, torch.Tensor]]:
    """Equal-size row chunks of at most micro_size rows (the reward model's passes; the policy and
    critic passes split through `micro_batches.py`)."""
    rows = next(iter(batch.values())).shape[0]
    size = max(d for d in range(1, min(micro_size, rows) + 1) if rows % d == 0)
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def mini_batches(batch: Dict[str, torch.Tensor], keys, rows: int, epochs: int):
    """`epochs` passes over consecutive row slices of `rows` (verl's ppo_epochs x mini-batches)."""
    total = batch[keys[0]].shape[0]
    for _ in range(epochs):
        for start in range(0, total, rows):
            yield {k: batch[k][start:start + rows] for k in keys}


class ModelEngine:
    """One role's model chunk (`module` may be wrapped in megatron DDP) and its process groups."""

    def __init__(self, module: torch.nn.Module, groups: ParallelGroups):
        self.module = module
        self.groups = groups
        self._last_stage_rank = dist.get_process_group_ranks(groups.pp_group)[-1]

    @property
    def config(self):
        from megatron.core.utils import get_model_config

        return get_model_config(self.module)

    def run(self, micro_batches: List[Dict[str, torch.Tensor]], loss_fn: Callable, forward_only: bool,
            token_fn: Callable | None = None) -> List[dict]:
        """Run every micro-batch through the model.

        `loss_fn(output, micro_batch) -> (loss_tensor, stats_dict)` runs on the last stage; the
        schedule divides the loss by the number of micro-batches before backward. With `token_fn`, output
        is its per-token results as [B, S] tensors in any sequence layout (`models.forward.pipeline_forward`).
        Returns the per-micro-batch stats dicts on every rank.
        """
        stats = pipeline_forward(self.module, micro_batches, loss_fn, forward_only, token_fn=token_fn)
        return self._from_last_stage(stats if self.groups.is_last_stage else None)

    def _from_last_stage(self, obj):
        """The last stage's results on every stage. They travel pickled, on the host: a pickled CUDA
        tensor would unpickle onto the sender's GPU."""
        if self.groups.pp == 1:
            return obj
        holder = [_to_device(obj, "cpu") if self.groups.is_last_stage else None]
        dist.broadcast_object_list(holder, src=self._last_stage_rank, group=self.groups.pp_group)
        return obj if self.groups.is_last_stage else _to_device(holder[0], self.groups.device)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def zero_grad(self) -> None:
        if hasattr(self.module, "zero_grad_buffer"):
            self.module.zero_grad_buffer()
        for p in self.module.parameters():
            p.grad = None

    def finish_grad_sync(self) -> None:
        """DP all-reduce of the gradients (megatron DDP's buffers)."""
        if hasattr(self.module, "finish_grad_sync"):
            self.module.finish_grad_sync()


def _to_device(obj, device):
    """`obj` (tensors in dicts, lists and tuples) with its tensors moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def dp_sum(values: Dict[str, object], groups: ParallelGroups) -> Dict[str, float]:
    """Sum a dict of floats and 0-d tensors over the data-parallel group (same keys on every rank): one
    all-reduce and one device-to-host read for all of them, so a step's metrics cost one sync."""
    keys = sorted(values)
    tensors = [k for k in keys if isinstance(values[k], torch.Tensor)]
    floats = [k for k in keys if k not in tensors]
    if groups.dp == 1 and not tensors:
        return {k: float(values[k]) for k in keys}
    device = groups.device if groups.dp > 1 else values[tensors[0]].device
    parts = [torch.tensor([float(values[k]) for k in floats], dtype=torch.float64).to(device, non_blocking=True)]
    if tensors:
        parts.append(torch.stack([values[k].detach().to(device, torch.float64) for k in tensors]))
    t = torch.cat(parts)
    if groups.dp > 1:
        dist.all_reduce(t, group=groups.dp_group)
    return dict(zip(floats + tensors, t.tolist()))
