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
