"""Rollout engines: the protocol (`base`), megatron KV-cache generation (`native`), vLLM (`vllm`), and
`generate_cli` (scripts/generate.py: the native engine on an HF folder, prompts from JSONL).

Engines are imported lazily so that importing the protocol never pulls in megatron or vLLM.

Rollout stands on placement (to receive weights), models, parallel, config, tokenizer and log; it must
not import data, workers, the planner or the trainer.
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

