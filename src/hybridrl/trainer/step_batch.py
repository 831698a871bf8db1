"""Tensors of one PPO step: prompts + rollout → the batch the workers consume; DP gather/slice.

The batch is placed on the run's device (`ParallelGroups.device`) once, here, where it is assembled;
every collective below runs on tensors of that device (nccl reduces CUDA tensors only).
One rank of each model replica (TP x CP x PP) generates its DP shard's rollout and broadcasts it to the
replica (`broadcast_rollout`), so peers never depend on separate generations agreeing bitwise.
Advantage estimation whitens over the whole batch (verl's single-controller semantics), so the
few [B, R] tensors it needs are gathered over DP and each rank keeps its own slice afterwards:
results do not depend on the DP size.
"""
from __future__ import annotations

import pickle
from typing import Dict

import torch
import torch.distributed as dist

from hybridrl.parallel.distributed import ParallelGroups


ROLLOUT_DTYPES = {"responses": torch.long, "response_mask": torch.float32, "rollout_log_probs": torch.float32}


def assemble(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
             response_mask: torch.Tensor, n: int, device=None,
             response_attention_mask: torch.Tensor | None = None) -> Dict[str, torch.Tensor]:
    """Left-padded prompts [B, P] repeated n times (prompt-major) + right-padded responses [B*n, R],
    all on `device` (default: the responses' device).

    response_mask is the loss mask; response_attention_mask marks the real response tokens (None:
    the same; multi-turn trajectories also hold tool output, real but outside the loss)."""
    device = responses.device if device is None else torch.device(device)
    responses, response_mask = responses.to(device), response_mask.to(device)
    prompts = prompt_ids.to(device).repeat_interleave(n, dim=0)
    pmask = prompt_mask.to(device).repeat_interleave(n, dim=0)
    real = response_mask if response_attention_mask is None else response_attention_mask.to(device)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([pmask.to(real.dtype), real.to(real.dtype)], dim=1),
        "prompt_mask": pmask,
        "responses": responses,
        "response_mask": response_mask.float(),
    }


def prompt_seeds(base: int, step: int, indices) -> list:
    """Sampling seed per prompt from its dataset row: the same whatever the DP/TP layout."""
    return [(base * 1_000_003 + step * 7_919 + int(i) * 104_729) % (2 ** 31 - 1) for i in indices]


def is_rollout_source(groups: ParallelGroups) -> bool:
    """Whether this rank generates its DP shard's rollout (rank 0 of its model replica, TP x CP x PP)."""
    return groups.replica_size == 1 or dist.get_rank(group=groups.replica) == 0


def broadcast_rollout(tensors: Dict[str, torch.Tensor] | None, rows: int, width: int,
                      groups: ParallelGroups, extra: Dict[str, tuple] | None = None) -> Dict[str, torch.Tensor]:
    """The source's rollout tensors ([rows, width], `ROLLOUT_DTYPES`, on groups.device) on every rank
    of its model replica; `tensors` is None on the other ranks. `extra` names further entries as
    key -> (shape, dtype) (a multi-turn rollout's masks and counters)."""
    if groups.replica_size == 1:
        return tensors
    specs = {key: ((rows, width), dtype) for key, dtype in ROLLOUT_DTYPES.items()}
    specs.update(extra or {})
    out = {}
    for key, (shape, dtype) in specs.items():
        if tensors is not None:
            t = tensors[key].to(device=groups.device, dtype=dtype).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=groups.device)
        dist.broadcast(t, group=groups.replica, group_src=0)
        out[key] = t
    return out


def once_per_replica(fn, groups: ParallelGroups, error=RuntimeError):
    """fn() on the model replica's rank 0 (the rollout source), its result (any picklable value) on every rank of
    the replica: a reward function that calls out (a judge, a sandbox) or draws at random runs once per row, and
    TP/PP peers train on the same scores. Where fn raises (or its result does not pickle), rank 0 raises that and
    its peers `error` naming it, instead of waiting for a result that never comes."""
    if groups.replica_size == 1:
        return fn()
    box, failure = [None], None
    if is_rollout_source(groups):
        try:
            box[0] = (True, fn())
            pickle.dumps(box[0])  # a result that cannot travel fails here, not inside the broadcast
        except Exception as err:
            failure, box[0] = err, (False, f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(box, group=groups.replica, group_src=0)
    ok, value = box[0]
    if failure is not None:
        raise failure
    if not ok:
        raise error(f"rank 0 of this model replica failed: {value}")
    return value


def gather_dp(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Concatenate the DP shards of `t` along dim 0 (same shape on every rank), on groups.device."""
    t = t.to(groups.device)
    if groups.dp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(groups.dp)]
    dist.all_gather(parts, t.contiguous(), group=groups.dp_group)
    return torch.cat(parts)


def gather_objects_dp(items: list, groups: ParallelGroups) -> list:
    """Concatenate every DP rank's list, in rank order (the global order of the prompts)."""
    parts = [None] * groups.dp
    dist.all_gather_object(parts, items, group=groups.dp_group)
    return [x for part in parts for x in part]


def local_slice(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    return dp_rows(t, groups.dp, groups.dp_rank)


def dp_rows(t: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """The rows of DP rank `dp_rank` of `dp` in a batch gathered over DP (`gather_dp`)."""
    rows = t.shape[0] // dp
    return t[dp_rank * rows:(dp_rank + 1) * rows]


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, R] to [B, width] (DP ranks may have generated different lengths)."""
    if t.shape[1] >= width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)



def route_columns(routes: torch.Tensor, response_width: int, prompt_width: int, width: int) -> torch.Tensor:
    """An engine's `routed_experts` [rows, P_e + response_width, L, k] (prompts left-padded to P_e) in the
    batch's columns [rows, prompt_width + width, L, k]: prompts right-aligned at the prompt/response
    boundary, responses from it; columns no token fills hold arange(k) (padding, masked in the loss)."""
    rows, p_in = routes.shape[0], routes.shape[1] - response_width
    if not 0 <= p_in <= prompt_width:
        raise ValueError(f"routes of {routes.shape[1]} columns with {response_width} response columns do not fit "
                         f"a prompt width of {prompt_width}")
    k = routes.shape[-1]
    out = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(
        rows, prompt_width + width, routes.shape[2], k).clone()
    out[:, prompt_width - p_in:prompt_width] = routes[:, :p_in]
    r = min(width, response_width)
    out[:, prompt_width:prompt_width + r] = routes[:, p_in:p_in + r]
    return out
