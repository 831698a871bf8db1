"""Section rollout: the generation engine, sampling, validation sampling and multi-turn tool use."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hybridrl.config.checks import check, one_of


@dataclass(frozen=True)
class ValKwargsConfig:
    n: int = 1
    """Responses per prompt during validation (mean@N, best@N, maj@N)."""
    do_sample: bool = False
    """Accepted from verl configs and, as in verl 0.9.1 (its agent loop applies the val temperature, top_p and
    top_k whatever do_sample says), not read: the temperature decides, 0 is greedy."""
    temperature: float = 0.0
    """Validation sampling temperature; 0: greedy."""
    top_p: float = 1.0
    """Validation nucleus mass (when sampling)."""
    top_k: int = -1
    """Validation top-k, -1 disables (when sampling)."""

    def __post_init__(self):
        check(self.n >= 1, "rollout.val_kwargs.n must be >= 1")
        check(self.n == 1 or self.temperature > 0,
               f"rollout.val_kwargs.n={self.n} at temperature 0 gives {self.n} identical greedy responses; "
               "set rollout.val_kwargs.temperature > 0, or n=1")
        check(self.temperature >= 0, "rollout.val_kwargs.temperature must be >= 0")
        check(0 < self.top_p <= 1, "rollout.val_kwargs.top_p must be in (0, 1]")


@dataclass(frozen=True)
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts: between turns the model may call tools (Hermes <tool_call> format)."""
    max_turns: int = 3
    """Most model turns per trajectory (verl's max_assistant_turns); calls in the last one are not run."""
    max_tool_response_length: int = 256
    """Characters of one tool result the model reads back; longer results are truncated."""
    max_parallel_calls: int = 1
    """Tool calls run per turn; further calls in the same turn are ignored."""
    tool_timeout_s: float = 10.0
    """A tool call running longer is abandoned and reported to the model as an error."""
    tools: List[str] = field(default_factory=lambda: ["calculator"])
    """Tools: built-in names (calculator) or 'package.module:function' entries, fn(**arguments) -> str."""

    def __post_init__(self):
        check(self.max_turns >= 1, "rollout.multi_turn.max_turns must be >= 1")
        check(self.max_tool_response_length >= 1, "rollout.multi_turn.max_tool_response_length must be >= 1")
        check(self.max_parallel_calls >= 1, "rollout.multi_turn.max_parallel_calls must be >= 1")
        check(self.tool_timeout_s > 0, "rollout.multi_turn.tool_timeout_s must be > 0")
        for entry in self.tools:
            check(entry.isidentifier() or entry.count(":") == 1,
                   f"rollout.multi_turn.tools entry {entry!r} must be a built-in name (calculator) or "
                   "'package.module:function'")


@dataclass(frozen=True)
class RolloutConfig:
    name: str = "native"
    """Inference engine: native (megatron-core KV cache) or vllm."""
    n: int = 1
    """Responses sampled per prompt (verl's default 1; group estimators such as grpo want more)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    tensor_model_parallel_size: int = 1
    """TP of the inference engine (may differ from training TP)."""
    update_weights_bucket_mb: float = 64
    """Size of one weight bucket streamed into the engine, in MiB (a fraction cuts a tiny model into several)."""
    verify_weights: str = "fingerprint"
    """Weight-sync check of what the engine stored: fingerprint (on device), exact (host hash), off."""
    share_weights: bool = True
    """Native engine colocated at rollout TP = TP, PP 1, EP 1: it reads the actor's own weight tensors (no
    copy, no second copy in memory; the sync checks identity, not bytes). false: copy them in (verified).
    Off with actor.lora (the engine needs the merged weights)."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory for weights + KV cache."""
    dtype: str = "bfloat16"
    """vLLM: dtype of the engine's weights and compute (verl's rollout.dtype); equal to model.params_dtype
    unless verify_weights=off (the native engine always runs in model.params_dtype)."""
    enforce_eager: bool = False
    """No CUDA graphs of the decode step (native and vLLM); CPU always runs eagerly."""
    max_num_seqs: int = 256
    """Sequences decoded at once: the native engine's KV-cache slots (refilled as rows stop); vLLM's max_num_seqs."""
    free_cache_engine: bool = True
    """Sleep the engine (free KV cache/weights) after each rollout."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling of validation (verl's rollout.val_kwargs)."""
    seed: int = 0
    """Sampling seed."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-calling rollouts (the agent loop)."""
    ignore_eos: bool = False
    """verl's: generate max_response_length tokens, past the EOS tokens (throughput measurements)."""
    do_sample: bool = True
    """verl's key; not read, as verl 0.9.1's agent loop does not: the temperature decides (0 is greedy)."""
    calculate_log_probs: bool = False
    """verl's key; not read: the engine's log-probs are always returned (rollout correction, bypass mode)."""
    prompt_length: Optional[int] = None
    """verl's copy of data.max_prompt_length (its YAML interpolates it); set, it must equal that."""
    response_length: Optional[int] = None
    """verl's copy of data.max_response_length (its YAML interpolates it); set, it must equal that."""

    def __post_init__(self):
        one_of("rollout.name", self.name, ("native", "vllm"))
        check(self.n >= 1, "rollout.n must be >= 1")
        check(self.temperature >= 0, "rollout.temperature must be >= 0")
        for key, t in (("rollout.temperature", self.temperature), ("rollout.val_kwargs.temperature",
                                                                   self.val_kwargs.temperature)):
            check(self.name != "vllm" or not 0 < t < 0.01,
                  f"{key}={t}: vLLM raises temperatures below 0.01 to 0.01 (its log-probs would be of another "
                  "distribution than the trainer's); use 0 (greedy) or >= 0.01")
        check(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        check(self.update_weights_bucket_mb > 0, "rollout.update_weights_bucket_mb must be > 0")
        check(self.max_num_seqs >= 1, "rollout.max_num_seqs must be >= 1 (KV-cache slots of the engine)")
        one_of("rollout.verify_weights", self.verify_weights, ("fingerprint", "exact", "off"))
        one_of("rollout.dtype", self.dtype, ("bfloat16", "float16", "float32"))
