"""verl's `trainer.balance_batch`: after generation and scoring, the step's prompt groups are moved between DP
ranks so that each rank's passes and updates see about the same number of tokens.

A generated batch is long on some ranks and short on others (one rank's prompts drew long answers): every
collective of the passes waits for the slowest. Balancing partitions the step's prompt groups (each prompt with
its `rollout.n` responses, kept whole so the group estimators see whole groups on one rank) into DP parts of
equal group count with the largest part's tokens (prompt + response, `attention_mask`) kept low: groups by
falling size, each to the lightest part that has room. verl partitions rows (Karmarkar-Karp) over the whole
batch; moving whole groups leaves every estimator as it is. Each rank then sends every group to its part's rank
in one all-to-all per tensor; a rank keeps its groups in the global prompt order.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from hybridrl.trainer.step_batch import gather_dp


WIRE_DTYPES = {torch.int16: torch.int32}
"""Moved widened: neither gloo nor nccl moves int16 (routed experts' ids)."""


def balancing(cfg) -> bool:
    """trainer.balance_batch as set, or where null (the default) on unless a step streams its prompts."""
    chosen = cfg.trainer.balance_batch
    return (not cfg.async_training.stream_prompts) if chosen is None else bool(chosen)


def balanced_parts(tokens: List[int], parts: int) -> List[List[int]]:
    """Indices of `tokens` (one count per group) in `parts` parts of equal size, each sorted: groups by falling
    count (ties: the lower index first), each to the part with the fewest tokens among those with room (ties:
    the lowest part)."""
    if len(tokens) % parts:
        raise ValueError(f"{len(tokens)} groups do not split into {parts} equal parts")
    room = len(tokens) // parts
    sums, members = [0] * parts, [[] for _ in range(parts)]
    for g in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        part = min((p for p in range(parts) if len(members[p]) < room), key=lambda p: (sums[p], p))
        members[part].append(g)
        sums[part] += tokens[g]
    return [sorted(m) for m in members]


def seqlen_metrics(tokens: torch.Tensor, parts: List[List[int]], dp: int) -> Dict[str, float]:
    """verl's global_seqlen/* metrics: tokens per DP rank as generated (min, max, minmax_diff) and after balancing
    (balanced_min, balanced_max), and their mean."""
    before = tokens.view(dp, -1).sum(-1).tolist()
    after = [int(tokens[p].sum()) for p in parts]
    return {"global_seqlen/min": float(min(before)), "global_seqlen/max": float(max(before)),
            "global_seqlen/minmax_diff": float(max(before) - min(before)),
            "global_seqlen/balanced_min": float(min(after)), "global_seqlen/balanced_max": float(max(after)),
            "global_seqlen/mean": float(sum(before)) / dp}


def balance_batch(batch: Dict[str, torch.Tensor], scores: torch.Tensor, n: int,
                  groups) -> Tuple[Dict[str, torch.Tensor], torch.Tensor, Dict[str, float]]:
    """(batch, scores, metrics) with this rank's prompt groups those of its balanced part. Every value of
    `batch` and `scores` holds one entry per row (row r of prompt group r // n). At DP 1 the batch stays as it is
    and the metrics are its own (min = max = mean: the step's tokens)."""
    if groups.dp == 1:  # nothing moves; the metrics still say how many tokens the step holds, as verl's do
        tokens = batch["attention_mask"].sum(-1).long().cpu()
        return batch, scores, seqlen_metrics(tokens, [list(range(tokens.numel()))], 1)
    rows = scores.shape[0]
    counts = gather_dp(torch.tensor([rows], dtype=torch.long), groups).tolist()
    if len(set(counts)) != 1 or rows % n:
        raise RuntimeError(f"trainer.balance_batch needs whole groups of rollout.n={n} rows and as many on every DP "
                           f"rank; the ranks hold {counts} rows")
    per_rank = rows // n
    tokens = gather_dp(batch["attention_mask"].sum(-1).view(per_rank, n).sum(-1).long(), groups).cpu()
    parts = balanced_parts(tokens.tolist(), groups.dp)
    own = range(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    send = [g - own.start for part in parts for g in part if g in own]  # local groups, by destination rank
    send_rows = [len([g for g in part if g in own]) * n for part in parts]
    receive_rows = [len([g for g in parts[groups.dp_rank] if g // per_rank == src]) * n for src in range(groups.dp)]
    index = (torch.tensor(send, dtype=torch.long)[:, None] * n + torch.arange(n)).reshape(-1)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] != rows:
            raise RuntimeError(f"trainer.balance_batch: a batch entry has {t.shape[0]} rows, the batch {rows}")
        wire = t.to(WIRE_DTYPES.get(t.dtype, t.dtype))
        out = wire.new_empty((sum(receive_rows),) + tuple(t.shape[1:]))
        dist.all_to_all_single(out, wire.index_select(0, index.to(t.device)).contiguous(), receive_rows, send_rows,
                               group=groups.dp_group)
        return out.to(t.dtype)

    moved = {key: move(t) for key, t in batch.items()}
    return moved, move(scores), seqlen_metrics(tokens, parts, groups.dp)
