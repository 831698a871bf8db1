"""The tensor-parallel collectives of the rollout engine's decode loop, on an explicit process group.

Plain torch.distributed calls without autograd: the decode loop needs no gradients, and every call
must be safe inside a CUDA-graph capture on NCCL (in-place all-reduce, all-gather into one
preallocated tensor). A group of size 1 returns its input untouched, so TP 1 pays nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Sum x over the group in place (the row-parallel half of a layer)."""
    if size > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[..., n] shards of the group -> [..., size * n] in rank order (column-parallel logits)."""
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, x, group=group)
    else:  # gloo: the list form, each entry a view of `out`
        dist.all_gather(list(out.unbind(0)), x, group=group)
    return out.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])
