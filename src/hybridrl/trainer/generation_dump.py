"""verl's generation dumps: `trainer.rollout_data_dir` gets each training step's responses, and
`trainer.validation_data_dir` each validation's, as `<step>.jsonl` with verl's fields.

A line per response: `input` (the prompt), `output` (the response; tool results included for a multi-turn
one), both decoded without special tokens as verl does, `gts` (the ground truth), `score` (the reward the
advantages see, before any KL penalty: verl's summed token_level_scores), `step`, and each per-response value
the reward function returned beside its score (`acc`, `pred`, a custom function's dict keys). Rows are in
the batch's global order (DP ranks in order); rank 0 writes. The file appears whole or not at all (written
to a temporary name, then renamed), so an interrupted run leaves no half file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from hybridrl.trainer.step_batch import gather_objects_dp


@dataclass
class RowInfo:
    """What the dump needs of each response that the tensors do not hold, in this rank's row order."""
    gts: List[Any] = field(default_factory=list)
    extras: Dict[str, List[Any]] = field(default_factory=dict)

    @staticmethod
    def of(ground_truths: List[Any], infos: Dict[str, List[Any]]) -> "RowInfo":
        return RowInfo(list(ground_truths), {k: list(v) for k, v in infos.items()})

    def rows(self) -> List[tuple]:
        """(ground truth, {key: value}) per response."""
        return [(gt, {k: v[i] for k, v in self.extras.items()}) for i, gt in enumerate(self.gts)]


def _texts(tok, batch: Dict[str, torch.Tensor]) -> tuple:
    """(prompts, responses) of a batch as text: real tokens only, special tokens skipped (verl's batch_decode)."""
    responses = batch["responses"].cpu()
    width = responses.shape[1]
    ids, real = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    prompts = [tok.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(ids[:, :-width], real[:, :-width])]
    outputs = [tok.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(responses, real[:, -width:])]
    return prompts, outputs


def write_generations(folder: str, step: int, lines: List[tuple]) -> str:
    """<folder>/<step>.jsonl, one line per (prompt, response, score, ground truth, extras); its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for prompt, response, score, gt, extras in lines:
            entry = {"input": prompt, "output": response, "gts": gt, "score": score, "step": step, **extras}
            f.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def publish_validation(trainer_cfg, step: int, local: List[tuple], groups, writer) -> None:
    """A validation's lines of every DP rank (this rank's: `local`), in rank order: `<step>.jsonl` in
    trainer.validation_data_dir (the first rank of the replicas writes), and trainer.log_val_generations of them
    to the metric writer, chosen as verl does (sorted by prompt, shuffled with seed 42, the first N)."""
    lines = gather_objects_dp(local, groups)
    if trainer_cfg.validation_data_dir and _writes(groups):
        write_generations(trainer_cfg.validation_data_dir, step, lines)
    if trainer_cfg.log_val_generations:
        writer.log_generations(pick_generations([line[:3] for line in lines], trainer_cfg.log_val_generations), step)


def pick_generations(samples: List[tuple], n: int) -> List[tuple]:
    """verl's choice of the (prompt, response, score) samples to show: sorted by prompt, shuffled by
    numpy's RandomState(42), the first n (the same prompts at every validation while the set is the same)."""
    import numpy as np

    samples = sorted(samples, key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]


def _writes(groups) -> bool:
    return (groups.dp_rank, groups.tp_rank, groups.pp_rank, groups.cp_rank) == (0, 0, 0, 0)


def dump_batch(folder: str, step: int, tok, batch: Dict[str, torch.Tensor], scores: torch.Tensor,
               rows: Optional[List[tuple]], groups) -> None:
    """A training step's batch; rows: (ground truth, extras) per response in global order (every rank holds
    them), or None where the step did not keep them."""
    texts = gather_objects_dp(list(zip(*_texts(tok, batch), scores.tolist())), groups)
    rows = rows if rows is not None else [(None, {})] * len(texts)
    if _writes(groups):
        write_generations(folder, step, [t + r for t, r in zip(texts, rows)])


def lines_of(tok, batch: Dict[str, torch.Tensor], scores: torch.Tensor, info: RowInfo) -> List[tuple]:
    """(prompt, response, score, ground truth, extras) of each response of this rank's batch."""
    return [t + r for t, r in zip(zip(*_texts(tok, batch), scores.tolist()), info.rows())]
