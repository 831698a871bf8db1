"""Atomic save / resume of training state.

Layout under `trainer.default_local_dir`:
    global_step_{k}/rank_{r:05d}.pt   per-rank state (model shards, optimizer, scheduler, RNG)
    global_step_{k}/meta.json         step, dataloader position, KL controller, world layout
    latest_checkpointed_iteration.txt the last complete step (verl's name)
A checkpoint is written into `global_step_{k}.tmp/` and renamed only after every rank finished,
then the pointer file is replaced atomically. A process killed mid-write leaves a `.tmp` folder
that is ignored (and removed by the next save): the previous checkpoint stays loadable.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Callable, Optional

import numpy as np
import torch

POINTER = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["tracker"] = get_cuda_rng_tracker().get_states()
    except Exception:  # tracker not initialised (single-process tools)
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "tracker" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, root: str, keep: int, rank: int, barrier: Callable[[], None] = lambda: None):
        self.root, self.keep, self.rank, self.barrier = root, keep, rank, barrier

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def save(self, step: int, rank_state: dict, meta: dict) -> str:
        """Every rank calls this collectively; returns the final folder."""
        final, tmp = self.step_dir(step), self.step_dir(step) + ".tmp"
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # leftovers of a killed save
                if name.endswith(".tmp") and os.path.isdir(os.path.join(self.root, name)):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            os.makedirs(tmp)
        self.barrier()
        torch.save(rank_state, os.path.join(tmp, f"rank_{self.rank:05d}.pt"))
        if self.rank == 0:
            _atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(dict(meta, step=step), indent=1))
        self.barrier()
        if self.rank == 0:
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write_text(os.path.join(self.root, POINTER), str(step))
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        steps = sorted(self.complete_steps())
        for old in steps[:-self.keep]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def complete_steps(self):
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            m = STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.root, name, "meta.json")):
                steps.append(int(m.group(1)))
        return steps

    def latest(self) -> Optional[str]:
        pointer = os.path.join(self.root, POINTER)
        if os.path.isfile(pointer):
            path = self.step_dir(int(open(pointer).read().strip()))
            if os.path.isfile(os.path.join(path, "meta.json")):
                return path
        steps = self.complete_steps()
        return self.step_dir(max(steps)) if steps else None

    def resolve(self, resume_mode: str) -> Optional[str]:
        """trainer.resume_mode: auto → latest complete checkpoint or None; disable → None; else a path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        if not os.path.isfile(os.path.join(resume_mode, "meta.json")):
            raise FileNotFoundError(f"trainer.resume_mode={resume_mode!r} is not a complete checkpoint folder "
                                    f"(no meta.json); use auto, disable, or a global_step_* folder")
        return resume_mode

    def load(self, path: str):
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        rank_file = os.path.join(path, f"rank_{self.rank:05d}.pt")
        if not os.path.isfile(rank_file):
            raise FileNotFoundError(f"checkpoint {path} has no state for rank {self.rank}; "
                                    f"resume with the same world size and layout it was saved with")
        return torch.load(rank_file, weights_only=False), meta
