"""Rollout engines: the protocol (`base`), megatron KV-cache generation (`native`), vLLM (`vllm`).

Engines are imported lazily so that importing the protocol never pulls in megatron or vLLM.

Rollout stands on placement (to receive weights), models, parallel and config; it must not import
data, workers, the planner or the trainer.
"""
from __future__ import annotations

from hybridrl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "NativeEngine", "VLLMEngine"]


def __getattr__(name):
    if name == "NativeEngine":
        from hybridrl.rollout.native import NativeEngine
        return NativeEngine
    if name == "VLLMEngine":
        from hybridrl.rollout.vllm import VLLMEngine
        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

