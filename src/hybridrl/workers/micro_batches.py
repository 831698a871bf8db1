"""Split a batch into micro-batches, cut each to its real columns, and put per-row results back.

Rows are split either by a fixed row count (`*_micro_batch_size_per_gpu`) or, with verl's
`use_dynamic_bsz`, by a token budget (`*_max_token_len_per_gpu`): rows are sorted by real length
and packed so that every micro-batch computes at most that many positions, with the fewest
micro-batches the budget allows and their costs balanced: real tokens when the forward packs rows
without padding (model.use_remove_padding, as verl counts), else rows x the trimmed width, padding
included (what bounds activation memory there; sorting keeps rows of similar length together). Either way every micro-batch is trimmed to the columns where at least
one of its rows holds a real token by `attention_mask`: shared left padding of the prompts and
shared right padding of the responses are not computed (expert-parallel peers agree on common widths,
`parallel/expert_lockstep.py`). Results come back per row, in the batch's
original order, padded to the full response width. No torch.distributed here.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from hybridrl.config.batching import MicroBatching
from hybridrl.parallel.expert_lockstep import width_agreement

FULL_WIDTH_KEYS = ("input_ids", "attention_mask", "position_ids", "routed_experts")
"""[B, prompt + response, ...] tensors; every other [B, R, ...] tensor is response-aligned."""


# ---- which rows go together ---------------------------------------------------------------

def real_spans(attention_mask: torch.Tensor, response_width: int):
    """Per row: real columns on the prompt side (counted from the prompt/response boundary to the
    first real token) and on the response side (from the boundary to the last real token), as lists."""
    prompt_width = attention_mask.shape[1] - response_width
    real = attention_mask.bool()
    prompt, response = real[:, :prompt_width], real[:, prompt_width:]
    none = torch.zeros_like(real[:, 0], dtype=torch.long)
    first = torch.where(prompt.any(1), prompt.int().argmax(1), none + prompt_width)
    last = torch.where(response.any(1), response_width - response.flip(1).int().argmax(1), none)
    return (prompt_width - first).tolist(), last.tolist()


def _pack(order: Sequence[int], spans_p, spans_r, bound: int) -> List[List[int]]:
    """Consecutive rows of `order` into micro-batches whose rows x width stays within bound."""
    parts, current, wp, wr = [], [], 1, 1
    for i in order:
        p, r = max(wp, spans_p[i]), max(wr, spans_r[i])
        if current and (len(current) + 1) * (p + r) > bound:
            parts.append(current)
            current, p, r = [], max(spans_p[i], 1), max(spans_r[i], 1)
        current.append(i)
        wp, wr = p, r
    return parts + [current] if current else parts


def _balanced_real(order: Sequence[int], widths, count: int) -> List[List[int]]:
    """Rows of `order` (longest first) into `count` micro-batches, each row to the lightest one so far
    (longest-processing-time-first): real-token loads balanced, as verl balances packed micro-batches."""
    parts, loads = [[] for _ in range(count)], [0] * count
    for i in order:
        j = loads.index(min(loads))
        parts[j].append(i)
        loads[j] += widths[i]
    return [sorted(p) for p in parts if p]


def _packed_plan(order: Sequence[int], widths, max_tokens: int) -> List[List[int]]:
    """The fewest micro-batches of packed rows whose balanced loads stay within max_tokens."""
    count = -(-sum(widths) // max_tokens)
    while True:
        parts = _balanced_real(order, widths, count)
        if max(sum(widths[i] for i in p) for p in parts) <= max_tokens:
            return parts
        count += 1


def token_budget_plan(spans_p, spans_r, max_tokens: int, packed: bool = False) -> List[List[int]]:
    """Longest rows first, packed into the fewest micro-batches within max_tokens, then the
    smallest per-micro-batch bound that still needs no more of them (balanced costs). A micro-batch costs
    rows x its width; with `packed` rows its real tokens, balanced longest-first over the fewest parts."""
    widths = [max(p, 1) + max(r, 1) for p, r in zip(spans_p, spans_r)]
    if max(widths) > max_tokens:
        raise ValueError(f"a row of {max(widths)} tokens does not fit the micro-batch budget of {max_tokens}")
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    if packed:
        return _packed_plan(order, widths, max_tokens)
    count = len(_pack(order, spans_p, spans_r, max_tokens))
    lo, hi = max(widths), max_tokens  # the fewest parts at hi; find the least bound with as few
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_pack(order, spans_p, spans_r, mid)) <= count else (mid + 1, hi)
    return _pack(order, spans_p, spans_r, lo)


def plan_micro_batches(batch: Dict[str, torch.Tensor], batching: MicroBatching) -> List[List[int]]:
    """Row indices of each micro-batch; fixed splits keep consecutive rows, in order."""
    rows = batch["attention_mask"].shape[0]
    if not batching.dynamic:
        size = max(1, batching.rows)
        return [list(range(i, min(i + size, rows))) for i in range(0, rows, size)]
    spans_p, spans_r = real_spans(batch["attention_mask"], batch["response_mask"].shape[1])
    return token_budget_plan(spans_p, spans_r, batching.max_tokens, batching.packed)


# ---- cutting and putting back -------------------------------------------------------------

def split_rows(batch: Dict[str, torch.Tensor], plan: List[List[int]], agree=None) -> List[Dict[str, torch.Tensor]]:
    """The micro-batch of each row list, cut to the columns holding a real token in one of its rows.
    `agree`: maps the per-micro-batch (prompt, response) widths to the ones peers use (expert parallel)."""
    R = batch["response_mask"].shape[1]
    P = batch["attention_mask"].shape[1] - R
    spans_p, spans_r = real_spans(batch["attention_mask"], R)  # one host read for all micro-batches
    widths = [(max(max(spans_p[i] for i in rows), 1), max(max(spans_r[i] for i in rows), 1)) for rows in plan]
    widths = agree(widths) if agree is not None else widths
    out = []
    for rows, (wp, wr) in zip(plan, widths):
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))  # then a view, no copy
        index = None if consecutive else torch.as_tensor(rows, device=batch["attention_mask"].device)
        mb = {}
        for key, value in batch.items():
            value = value[rows[0]:rows[0] + len(rows)] if index is None else value.index_select(0, index)
            mb[key] = _columns(key, value, P, R, wp, wr)
        out.append(mb)
    return out


def _columns(key: str, value: torch.Tensor, P: int, R: int, wp: int, wr: int) -> torch.Tensor:
    if key in FULL_WIDTH_KEYS:
        return value[:, P - wp:P + wr]
    if value.dim() >= 2 and value.shape[1] == R:
        return value[:, :wr]
    return value


def scatter_rows(parts: List[torch.Tensor], plan: List[List[int]], width: int) -> torch.Tensor:
    """Per-micro-batch [b, r<=width, ...] results -> one [B, width, ...] tensor in the original row
    order, zero in the trimmed columns."""
    rows = sum(len(p) for p in plan)
    first = parts[0]
    out = first.new_zeros((rows, width) + tuple(first.shape[2:]))
    for index, part in zip(plan, parts):
        out[torch.as_tensor(index, device=part.device), :part.shape[1]] = part
    return out


def run_per_row(engine, batch: Dict[str, torch.Tensor], batching: MicroBatching, loss_fn,
                token_fn=None) -> Dict[str, torch.Tensor]:
    """A forward-only pass of `engine` over `batch`: every tensor loss_fn returns per micro-batch,
    put back in row order at the full response width."""
    plan = plan_micro_batches(batch, batching)
    parts = engine.run(split_rows(batch, plan, width_agreement(engine.groups)), loss_fn, True, token_fn)
    width = batch["response_mask"].shape[1]
    return {key: scatter_rows([p[key] for p in parts], plan, width) for key in parts[0]}
