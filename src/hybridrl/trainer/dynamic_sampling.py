"""DAPO dynamic sampling (`algorithm.filter_groups`): keep generating until the batch holds enough
groups whose rewards differ.

A group (the rollout.n responses of one prompt) whose `filter_groups.metric` values are all equal has
zero GRPO advantage everywhere and only dilutes the loss, so it is dropped; more prompt batches are
generated until `data.train_batch_size` groups are kept (at most `max_num_gen_batches` batches; <= 0
means no limit), and the surplus past that is cut, as verl's DAPO trainer does. A singleton group
(rollout.n = 1) is always kept.

Groups are kept in the DP-global order (generation batch, then the prompt's place in the global
batch): after each generation batch the kept rows of every DP rank are gathered, so every rank holds
the same global list, and each rank then takes its equal slice of the first train_batch_size groups.
The result is the batch a single process would build, at any DP size.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hybridrl.trainer.step_batch import gather_dp, gather_objects_dp, local_slice

Batch = Dict[str, torch.Tensor]
PROMPT_COLUMNS = ("input_ids", "attention_mask", "prompt_mask")  # left-padded prompt part first


class FilterGroupsError(RuntimeError):
    """Dynamic sampling cannot fill the batch (or its metric is missing); the message names the fix."""


def filter_values(metric: str, raw_scores: torch.Tensor, scores: torch.Tensor,
                  infos: Dict[str, list]) -> torch.Tensor:
    """The per-response values compared within a group.

    score: the reward function's score; reward (verl 0.9.1's name) or seq_reward (verl's DAPO recipe's): the
    score after overlong shaping (what the advantages see); acc: the reward's "acc" value where it returns
    one, else its score (verl's DAPO reward manager records a plain score as acc); any other name: that
    numeric key of the reward's returned dict."""
    if metric == "score":
        return raw_scores
    if metric in ("reward", "seq_reward"):
        return scores
    values = infos.get(metric)
    if metric == "acc" and (values is None or any(v is None for v in values)):
        return raw_scores
    if values is None or any(not isinstance(v, (int, float)) for v in values):
        raise FilterGroupsError(f"algorithm.filter_groups.metric={metric!r} is not a numeric value of every response "
                         f"(the reward returns {sorted(infos) or 'only a score'}); use reward, acc, score "
                         "or a numeric key of your reward function's dict")
    return torch.tensor([float(v) for v in values], dtype=torch.float64, device=raw_scores.device)


def kept_groups(values: torch.Tensor, n: int) -> torch.Tensor:
    """[G] bool: the group's values are not all equal (or it has one response)."""
    grouped = values.reshape(-1, n)
    if n == 1:
        return torch.ones(grouped.shape[0], dtype=torch.bool, device=values.device)
    return grouped.max(dim=1).values != grouped.min(dim=1).values


def left_pad_prompts(batch: Batch, width: int, pad_id: int) -> Batch:
    """Widen the left-padded prompt part of a batch to `width` prompt tokens."""
    extra = width - batch["prompt_mask"].shape[1]
    if extra <= 0:
        return batch
    out = dict(batch)
    for key in PROMPT_COLUMNS:
        t = batch[key]
        fill = pad_id if key == "input_ids" else 0
        pad = torch.full((t.shape[0], extra), fill, dtype=t.dtype, device=t.device)
        out[key] = torch.cat([pad, t], dim=1)
    return out


def concat_batches(parts: Sequence[Batch], pad_id: int) -> Batch:
    """Row-concatenate batches whose prompt parts may differ in width."""
    width = max(p["prompt_mask"].shape[1] for p in parts)
    parts = [left_pad_prompts(p, width, pad_id) for p in parts]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def gather_rows(t: torch.Tensor, counts: List[int], groups) -> torch.Tensor:
    """Concatenate, in DP-rank order, the first counts[r] rows of every rank's `t`."""
    most = max(counts)
    if t.shape[0] < most:
        pad = torch.zeros((most - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        t = torch.cat([t, pad])
    full = gather_dp(t[:most], groups)
    return torch.cat([full[r * most:r * most + c] for r, c in enumerate(counts)])


def _kept_global(batch: Batch, scores: torch.Tensor, keep: torch.Tensor, n: int, groups):
    """This generation batch's kept rows of all DP ranks, in global order, on every rank."""
    rows = keep.repeat_interleave(n)
    counts = [int(c) for c in gather_dp(rows.sum().reshape(1), groups).tolist()]
    kept = {k: gather_rows(v[rows], counts, groups) for k, v in batch.items()}
    return kept, gather_rows(scores[rows], counts, groups)


def sample_filtered(generate_and_score: Callable, prompts, next_prompts: Optional[Callable], cfg, groups,
                    pad_id: int, step: int, rows_of: Optional[Callable] = None,
                    kept_rows: Optional[list] = None) -> Tuple[Batch, torch.Tensor, Dict[str, float]]:
    """(this rank's batch, its scores, metrics) of train_batch_size kept groups.

    `generate_and_score(prompts) -> (batch, scores, raw_scores, infos)` runs one generation batch on
    this rank; `next_prompts()` gives the next prompt batch of the data loader. With `kept_rows` (a list),
    `rows_of()` gives a per-row object of the batch just scored on this rank, and kept_rows gets those of the
    kept rows of every rank, in the global order of the returned batch."""
    fg, n, target = cfg.algorithm.filter_groups, cfg.rollout.n, cfg.data.train_batch_size
    kept_batches, kept_scores, num_kept = [], [], 0
    for num_gen_batches in itertools.count(1):
        batch, scores, raw_scores, infos = generate_and_score(prompts)
        keep = kept_groups(filter_values(fg.metric, raw_scores, scores, infos), n)
        part, part_scores = _kept_global(batch, scores, keep, n, groups)
        if kept_rows is not None:
            rows = gather_dp(keep.repeat_interleave(n).to(torch.int32), groups).tolist()
            kept_rows += [r for r, k in zip(gather_objects_dp(rows_of(), groups), rows) if k]
        kept_batches.append(part)
        kept_scores.append(part_scores)
        num_kept += part_scores.shape[0] // n
        if num_kept >= target:
            break
        if 0 < fg.max_num_gen_batches <= num_gen_batches:
            raise FilterGroupsError(
                f"step {step}: {num_gen_batches} generation batches kept {num_kept} of {target} groups whose "
                f"rewards differ (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); the "
                "prompts may be too easy or too hard: raise the limit, set it to 0 for no limit, or change the data")
        if next_prompts is None:
            raise RuntimeError("algorithm.filter_groups needs more prompts but this step was given no prompt source")
        prompts = next_prompts()
    rows = target * n
    if kept_rows is not None:
        del kept_rows[rows:]
    full = {k: v[:rows] for k, v in concat_batches(kept_batches, pad_id).items()}
    metrics = {"train/num_gen_batches": float(num_gen_batches),
               "train/filter_groups/kept_ratio": num_kept / (num_gen_batches * target)}
    return ({k: local_slice(v, groups) for k, v in full.items()}, local_slice(torch.cat(kept_scores)[:rows], groups),
            metrics)
