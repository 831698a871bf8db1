"""Expert-parallel ranks forward in lockstep: the same micro-batch count and the same shapes.

megatron's allgather token dispatcher gathers every EP rank's tokens of one MoE layer into one tensor, so
the ranks of an EP group must run the same number of micro-batches, each with the same [B, S] (a tensor
all-gather needs equal sizes). Fixed-size micro-batches already agree on B; the trimmed widths of each
micro-batch are agreed here as the maximum over the group (more padding columns, masked as padding).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

Widths = List[Tuple[int, int]]


def width_agreement(groups) -> Callable[[Widths], Widths] | None:
    """A function from this rank's per-micro-batch (prompt, response) widths to the group's; None at EP 1."""
    if groups.ep == 1:
        return None

    def agree(widths: Widths) -> Widths:  # on the run's device: the expert group is nccl on GPUs
        local = torch.tensor([len(widths), -len(widths)] + [w for pair in widths for w in pair], dtype=torch.long,
                             device=groups.device)
        count = local[:2].clone()
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=groups.ep_group)
        most, fewest = count[0].item(), -count[1].item()
        if most != fewest:
            raise RuntimeError(f"expert-parallel ranks split their rows into different numbers of micro-batches "
                               f"({fewest} to {most}); with parallel.expert_model_parallel_size > 1 "
                               "use fixed micro-batch sizes (use_dynamic_bsz=false)")
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=groups.ep_group)
        flat = local[2:].tolist()
        return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]

    return agree


def agree_max(values: List[int], group, device) -> List[int]:
    """The element-wise maximum of `values` over `group` (every rank passes as many): the packed length of
    each micro-batch that expert-parallel peers share."""
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
