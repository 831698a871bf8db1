"""Tensors of one PPO step: prompts + rollout → the batch the workers consume; DP gather/slice.

Advantage estimation whitens over the whole batch (verl's single-controller semantics), so the
few [B, R] tensors it needs are gathered over DP and each rank keeps its own slice afterwards:
results do not depend on the DP size.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from hybridrl.parallel.distributed import ParallelGroups


def assemble(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
             response_mask: torch.Tensor, n: int) -> Dict[str, torch.Tensor]:
    """Left-padded prompts [B, P] repeated n times (prompt-major) + right-padded responses [B*n, R]."""
    prompts = prompt_ids.repeat_interleave(n, dim=0)
    pmask = prompt_mask.repeat_interleave(n, dim=0)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([pmask.to(response_mask.dtype), response_mask], dim=1),
        "prompt_mask": pmask,
        "responses": responses,
        "response_mask": response_mask.float(),
    }


def gather_dp(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Concatenate the DP shards of `t` along dim 0 (same shape on every rank)."""
    if groups.dp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(groups.dp)]
    dist.all_gather(parts, t.contiguous(), group=groups.dp_group)
    return torch.cat(parts)


def local_slice(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    rows = t.shape[0] // groups.dp
    return t[groups.dp_rank * rows:(groups.dp_rank + 1) * rows]


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, R] to [B, width] (DP ranks may have generated different lengths)."""
    if t.shape[1] >= width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)

