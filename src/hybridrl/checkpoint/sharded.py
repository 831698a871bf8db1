"""One trainable role (model + optimizer) as megatron-core sharded state dicts, read and written with
`megatron.core.dist_checkpointing` (torch_dist format, i.e. torch.distributed.checkpoint).

Each tensor is described by its global shape and this rank's place in it (TP slice, PP layer
offset, vocab padding) and written once by its main replica whatever DP is, so a checkpoint loads
at any TP x PP x DP. Optimizer states follow their parameters' layout under megatron's names
(`optimizer.state.exp_avg.<param key>`). Collective: every rank of the run calls these together.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from hybridrl.checkpoint.folders import CheckpointError
from hybridrl.checkpoint.resume import naming_damage
from hybridrl.models.critic import ValueHead, critic_sharded_state_dict
from hybridrl.models import lora
from hybridrl.models.hf_checkpoint import unwrap_model


def model_sharded_state(module, metadata: Optional[dict] = None) -> dict:
    """megatron's sharded state dict of an actor / reference / critic chunk (DDP wrappers removed)."""
    gpt = unwrap_model(module)
    if isinstance(getattr(gpt, "output_layer", None), ValueHead):
        return critic_sharded_state_dict(gpt, metadata)
    return lora.adapter_state(gpt, gpt.sharded_state_dict(metadata=metadata))  # LoRA: the adapters only


def role_state(worker, is_loading: bool = False) -> dict:
    """{"model": ..., "optimizer": ...} of an ActorWorker / CriticWorker, ready for save or load."""
    model = model_sharded_state(worker.engine.module)
    return {"model": model, "optimizer": worker.optimizer.sharded_state_dict(model, is_loading=is_loading)}


def _sharded_tensors(state: dict):
    """The ShardedTensors of a sharded state dict, factories (e.g. SwiGLU's fused fc1) built out."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    out = []
    for v in nested_values(state):
        if isinstance(v, ShardedTensorFactory):
            out += _sharded_tensors({"built": v.build()})
        elif isinstance(v, ShardedTensor):
            out.append(v)
    return out


def _shape_problem(model_state: dict, saved: dict) -> Optional[str]:
    for sh in _sharded_tensors(model_state):
        want = tuple(sh.global_shape)
        if sh.key not in saved:
            return f"has no tensor {sh.key!r} (this model: shape {list(want)})"
        got = tuple(saved[sh.key].global_shape)
        # vocab rows are padded per TP size (allow_shape_mismatch): only the other dims must agree
        same = got[1:] == want[1:] if sh.allow_shape_mismatch else got == want
        if not same or len(got) != len(want):
            return f"has tensor {sh.key!r} with shape {list(got)}, this model's is {list(want)}"
    return None


def check_shapes(model_state: dict, folder: str, role: str) -> None:
    """Raise the same CheckpointError on every rank when `folder` does not fit this model (collective)."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(folder)
    local = ({sh.key for sh in _sharded_tensors(model_state)}, _shape_problem(model_state, saved))
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, local)
    problem = next((p for _, p in views if p), None)
    if problem is None:
        known = set().union(*(keys for keys, _ in views))
        extra = sorted(k for k in saved if not k.startswith("optimizer.") and k not in known)
        if extra:
            problem = f"has tensor {extra[0]!r} with shape {list(saved[extra[0]].global_shape)}, " \
                      f"which this model does not have"
    if problem:
        raise CheckpointError(f"the {role} checkpoint {folder} {problem}: it was saved from a different "
                              f"model; resume with the model.* settings it was saved with, or start a "
                              f"new run (trainer.resume_mode=disable) from its HF export")


def save_role(worker, folder: str, async_save: bool):
    """Write one role into `folder` (exists, empty); returns megatron's AsyncRequest when async."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.save(role_state(worker), folder, async_sharded_save=async_save)


def load_role(worker, folder: str, role: str) -> None:
    """Fill this rank's model and optimizer shards from `folder`, whatever layout wrote it."""
    from megatron.core import dist_checkpointing

    with naming_damage(os.path.dirname(os.path.normpath(folder)), role):
        check_shapes(model_sharded_state(worker.engine.module), folder, role)
        loaded = dist_checkpointing.load(role_state(worker, is_loading=True), folder)
    fill_model(worker.engine.module, loaded["model"], folder, role)
    worker.optimizer.load_sharded_state_dict(loaded["optimizer"])


def fill_model(module, loaded: dict, folder: str, role: str) -> None:
    """Copy a loaded model state dict in; every weight must be there (`_extra_state` may be absent)."""
    result = unwrap_model(module).load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if lora.must_fill(module, k)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the {role} checkpoint {folder} did not fill {missing[:3]} "
                              f"(unexpected: {result.unexpected_keys[:3]})")
