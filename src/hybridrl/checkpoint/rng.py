"""Random-number generator states of one process (torch, numpy, python, CUDA, megatron's tracker).

Saved per rank and restored only when a run resumes at the layout it was saved with; at another
layout the streams start from trainer.seed (rollout sampling seeds come from the dataset row and
the step, so generation does not depend on them).
"""
from __future__ import annotations

import random

import numpy as np
import torch


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
