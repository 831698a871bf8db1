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
from typing import Any, Dict, List

import torch


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


def texts(tok, batch: Dict[str, torch.Tensor]) -> tuple:
    """(prompts, responses) of a batch as text: real tokens only, special tokens skipped (verl's batch_decode)."""
    responses = batch["responses"].cpu()
    width = responses.shape[1]
    ids, real = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    prompts = [tok.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(ids[:, :-width], real[:, :-width])]
    outputs = [tok.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(responses, real[:, -width:])]
    return prompts, outputs


def write_generations(folder: str, step: int, inputs: List[str], outputs: List[str], rows: List[tuple],
                      scores: List[float]) -> str:
    """<folder>/<step>.jsonl, one line per response (rows: (ground truth, extras) each); its path."""
    if not len(inputs) == len(outputs) == len(rows) == len(scores):
        raise ValueError(f"generation dump of step {step}: {len(inputs)} prompts, {len(outputs)} responses, "
                         f"{len(rows)} ground truths and {len(scores)} scores")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for prompt, response, (gt, extras), score in zip(inputs, outputs, rows, scores):
            entry = {"input": prompt, "output": response, "gts": gt, "score": score, "step": step, **extras}
            f.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path
