"""Rows of rollout outputs: slice one to a DP rank's rows, join the answers of several engines into one.

Every per-row field of a `RolloutOutput` travels (tensors whose first dim is the row count); 2-D fields are
right-padded to the widest part, routed experts re-aligned on the prompt/response boundary.
"""
from __future__ import annotations

import dataclasses

import torch

from hybridrl.rollout.base import RolloutOutput
from hybridrl.trainer.step_batch import route_columns


def row_versions(out: RolloutOutput, version: int) -> torch.Tensor:
    """The weight version behind each response row: the call's first, plus the updates taken in before
    the row started (partial rollout); the oldest version that produced any of its tokens."""
    rows = out.responses.shape[0]
    return version + (out.weight_epochs if out.weight_epochs is not None else torch.zeros(rows, dtype=torch.long))


def _per_row(out: RolloutOutput) -> dict:
    """The fields of an output with one entry per response row (tensors [rows] or [rows, width])."""
    rows = out.responses.shape[0]
    return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)
            if isinstance(getattr(out, f.name), torch.Tensor) and getattr(out, f.name).shape[:1] == (rows,)}


def output_rows(out: RolloutOutput, rows: slice) -> RolloutOutput:
    return dataclasses.replace(out, **{k: v[rows] for k, v in _per_row(out).items()})


def join_outputs(parts: list, pad_id: int) -> RolloutOutput:
    """Outputs of consecutive prompt ranges as one, right-padded to the widest; engine counters summed."""
    if len(parts) == 1:
        return parts[0]
    fields = {}
    for k, v in _per_row(parts[0]).items():
        if v.dim() == 1:
            fields[k] = torch.cat([getattr(p, k) for p in parts])
            continue
        if k == "routed_experts":  # [rows, P + R, L, k]: prompt columns right-aligned, responses after them
            p_w = max(p.routed_experts.shape[1] - p.responses.shape[1] for p in parts)
            r_w = max(p.responses.shape[1] for p in parts)
            fields[k] = torch.cat([route_columns(p.routed_experts, p.responses.shape[1], p_w, r_w) for p in parts])
            continue
        width = max(getattr(p, k).shape[1] for p in parts)
        fill = pad_id if k == "responses" else 0
        fields[k] = torch.cat([torch.nn.functional.pad(getattr(p, k), (0, width - getattr(p, k).shape[1]), value=fill)
                               for p in parts])
    stats = {}
    for p in parts:
        for k, v in p.stats.items():
            stats[k] = stats.get(k, 0) + v
    return dataclasses.replace(parts[0], stats=stats, **fields)


# ---- rows on the wire (split placement) ------------------------------------------------------------

_MASKS = ("response_mask", "attention_mask")


def tensor_bytes(obj) -> int:
    """Bytes of the tensors inside `obj` (dicts, lists, tuples, dataclasses): what rows cost on a bridge."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return sum(tensor_bytes(x) for x in obj) if isinstance(obj, (list, tuple)) else 0


def compact_rows(out: RolloutOutput) -> RolloutOutput:
    """`out` as it crosses to the trainers: response columns (routed experts' too) cut after the rows' last
    real token, token ids int32, 0/1 masks bool (`full_rows` undoes the types)."""
    real = out.attention_mask if out.attention_mask is not None else out.response_mask
    width = int((real != 0).any(0).nonzero().max()) + 1 if real.numel() and bool((real != 0).any()) else 0
    fields, cut = {}, out.responses.shape[1] - width
    for k, v in _per_row(out).items():
        if k == "routed_experts":  # [rows, P + R, ...]: the response columns end it
            v = v[:, :v.shape[1] - cut]
        elif v.dim() == 2 and v.shape[1] == out.responses.shape[1]:
            v = v[:, :width]
        fields[k] = v.int() if k == "responses" else v.bool() if k in _MASKS else v
    return dataclasses.replace(out, **fields)


def full_rows(out: RolloutOutput) -> RolloutOutput:
    """The trainer's types back (long token ids, float masks); a full-typed output passes unchanged."""
    fields = {"responses": out.responses.long()}
    fields.update({k: getattr(out, k).float() for k in _MASKS if getattr(out, k) is not None})
    return dataclasses.replace(out, **fields)


def group_messages(msg: dict, counts: list):
    """One chunk of an answer cut per trainer DP group: (dp rank, the message of the rows of its prompts
    [lo, hi) of the request, compact) for each group (empty where none of its prompts is in the chunk)."""
    first, n = 0, msg["n"]
    for d, count in enumerate(counts):
        lo, hi = max(msg["lo"], first), min(msg["hi"], first + count)
        hi, first = max(lo, hi), first + count
        rows = slice((lo - msg["lo"]) * n, (hi - msg["lo"]) * n)
        yield d, dict(msg, lo=lo, hi=hi, out=compact_rows(output_rows(msg["out"], rows)))


def merge_messages(parts: list, pad_id: int) -> list:
    """Every DP rank's messages of one answer (`parts[d]`, in chunk order) as whole-chunk messages."""
    merged = []
    for chunk in zip(*parts):
        rows = [m for m in chunk if m["hi"] > m["lo"]]
        merged.append(dict(rows[0], lo=rows[0]["lo"], hi=rows[-1]["hi"],
                           out=join_outputs([full_rows(m["out"]) for m in rows], pad_id)))
    return merged
