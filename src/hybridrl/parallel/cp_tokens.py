"""Per-token results of a context-parallel forward, gathered over the CP group.

Each CP rank computes log-probs, entropy or values for its own tokens of a pack (`models/packing.py`).
The loss needs them all, in pack order: they are all-gathered (a few floats per token, never the
logits) and put in pack order. Every CP rank then computes the same loss from the same tensor, so in
backward each rank keeps the gradient of its own tokens and sends nothing; the parameter gradients are
partial over the CP ranks' tokens: megatron's schedule multiplies each loss by CP and DDP averages over
DP x CP, which together sum them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, positions, group):
        cp = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        all_positions = [torch.empty_like(positions) for _ in range(cp)]
        dist.all_gather(all_positions, positions, group=group)
        whole = local.new_empty((local.shape[0] * cp,) + tuple(local.shape[1:]))
        whole[torch.cat(all_positions)] = torch.cat(parts)
        ctx.save_for_backward(positions)
        return whole

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        return grad[positions], None, None


def gather_tokens(local: torch.Tensor, positions: torch.Tensor, group) -> torch.Tensor:
    """[1, T_local, ...] of this rank at pack `positions` [T_local] -> [1, T, ...] of every CP rank, in pack order."""
    return _GatherTokens.apply(local.squeeze(0), positions, group).unsqueeze(0)
