"""Synthetic prompt sets for the CPU demo, written in the same parquet layout as real data.

`arith`: single-digit addition. The user content is "3+4=" and the ground truth "7"
(data_source "synthetic/arith", scored by `hybridrl.rewards.arith`). With builtin:tiny the prompt
is exactly those four characters, so a tiny random-init model can learn the task with RL alone.
`write_arith_demonstrations` writes the same task's SFT warm-up (prompt, right sum).
`arith_tools`: two-digit multiplication for the tool-calling demo (`hybridrl.data.tool_demos`).
`ensure_synthetic_data(cfg)` generates missing train/val files when `data.synthetic_task` is set.
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict, List, Tuple

from hybridrl.config import DataConfig
from hybridrl.data.prompts import write_prompt_parquet

ARITH_SOURCE = "synthetic/arith"


def arith_rows(n: int, seed: int, split: str, max_operand: int = 9) -> List[Dict[str, Any]]:
    """n addition prompts a+b= with operands in [0, max_operand], drawn with a seeded RNG."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({
            "data_source": ARITH_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "arith",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        })
    return rows


def arith_demonstration_rows(n: int, seed: int, max_operand: int = 9) -> List[Dict[str, Any]]:
    """SFT trajectories of the addition task: the prompt and the right sum, as chat messages."""
    return [{"data_source": ARITH_SOURCE, "messages": [{"role": "user", "content": row["prompt"][0]["content"]},
                                                       {"role": "assistant", "content": row["reward_model"]["ground_truth"]}]}
            for row in arith_rows(n, seed, "sft", max_operand)]


def write_arith_demonstrations(path: str, n: int = 2000, seed: int = 11) -> str:
    """A parquet file of `n` addition demonstrations for the demo's short SFT warm-up (atomic write)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_prompt_parquet(arith_demonstration_rows(n, seed), path)


def write_synthetic_arith(folder: str, n_train: int = 2000, n_test: int = 100, seed: int = 0,
                          max_operand: int = 9) -> Tuple[str, str]:
    """Write folder/train.parquet and folder/test.parquet; returns their paths."""
    train = write_prompt_parquet(arith_rows(n_train, seed, "train", max_operand),
                                 os.path.join(folder, "train.parquet"))
    test = write_prompt_parquet(arith_rows(n_test, seed + 1, "test", max_operand),
                                os.path.join(folder, "test.parquet"))
    return train, test


def ensure_synthetic_data(cfg: DataConfig, n_train: int = 2000, n_test: int = 100) -> List[str]:
    """Generate the missing data.train_files/val_files when data.synthetic_task is set (validated with the config).

    Returns the files written (none when all exist or the task is empty). Deterministic and
    written atomically, so every rank may call it; the entry point calling it once is cheaper.
    """
    if not cfg.synthetic_task:
        return []
    from hybridrl.data.tool_demos import arith_tools_rows

    rows = arith_rows if cfg.synthetic_task == "arith" else arith_tools_rows
    missing = [(os.path.expanduser(p), "train") for p in cfg.train_files]
    missing += [(os.path.expanduser(p), "test") for p in cfg.val_files]
    missing = [(p, split) for p, split in missing if not os.path.exists(p)]
    for path, split in missing:
        base = 1 if cfg.seed is None else cfg.seed  # the generated files do not change with a drawn seed
        n, seed = (n_train, base) if split == "train" else (n_test, base + 1)
        write_prompt_parquet(rows(n, seed, split), path)
    return [p for p, _ in missing]
