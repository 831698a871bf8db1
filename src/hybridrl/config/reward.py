"""Sections reward and reward_model: rule scorers, user functions, overlong shaping, a trained reward model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridrl.config.checks import check, one_of
from hybridrl.config.training import OptimConfig


@dataclass(frozen=True)
class CustomRewardConfig:
    path: Optional[str] = ""
    """Python file with a user reward function; empty or null (verl's default): the built-in registry by
    data_source."""
    name: Optional[str] = "compute_score"
    """Name of the function in that file; null: compute_score (verl's)."""

    def __post_init__(self):
        object.__setattr__(self, "path", self.path or "")
        object.__setattr__(self, "name", self.name or "compute_score")


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong shaping: penalise responses longer than data.max_response_length - len."""
    len: int = 0
    """Tokens of the buffer at the end of the response length where the penalty ramps up."""
    penalty_factor: float = 1.0
    """Penalty at the full response length (linear from 0 at the buffer start)."""

    def __post_init__(self):
        check(not self.enable or self.len > 0, "reward.overlong_buffer.len must be > 0 when enabled")
        check(self.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor must be >= 0")


GSM8K_METHODS = ("strict", "flexible", "flexible_lenient")


@dataclass(frozen=True)
class RewardConfig:
    custom_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    """User reward function."""
    gsm8k_method: str = "strict"
    """strict ("#### " then the number) or flexible (last number), both as verl; flexible_lenient
    (last number, commas/$/final period stripped) is hybridrl's own."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong reward shaping."""

    def __post_init__(self):
        one_of("reward.gsm8k_method", self.gsm8k_method, GSM8K_METHODS)


REWARD_COMBINE_MODES = ("replace", "add")


@dataclass(frozen=True)
class RewardModelTrainConfig:
    steps: int = 150
    """scripts/train_rm.py: optimizer steps of the Bradley-Terry training."""
    batch_size: int = 32
    """Preference pairs per optimizer step, over all DP ranks."""
    micro_batch_size_per_gpu: int = 32
    """Pairs per forward/backward on one DP rank (each pair is two sequences)."""
    num_pairs: int = 4096
    """Training pairs generated from the prompts of data.train_files."""
    num_val_pairs: int = 256
    """Held-out pairs generated from data.val_files, for the printed preference accuracy."""
    val_freq: int = 25
    """Evaluate the held-out accuracy every this many steps and at the end; 0: only at the end."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer and LR schedule of the reward model."""
    seed: int = 7
    """Seed of the pair generator and of the fresh score head."""

    def __post_init__(self):
        check(self.steps >= 1, "reward_model.train.steps must be >= 1")
        check(self.batch_size >= 1 and self.micro_batch_size_per_gpu >= 1,
               "reward_model.train.batch_size and .micro_batch_size_per_gpu must be >= 1")
        check(self.num_pairs >= self.batch_size,
               "reward_model.train.num_pairs must be at least one batch (reward_model.train.batch_size)")
        check(self.num_val_pairs >= 1, "reward_model.train.num_val_pairs must be >= 1")


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = False
    """Score responses with a reward model: a frozen megatron-core GPTModel with a scalar head."""
    path: str = ""
    """HF folder of a Qwen2/Llama *ForSequenceClassification model (score.weight); train_rm.py writes one."""
    tokenizer: str = ""
    """Tokenizer of the reward model; empty: data.tokenizer. Another one: responses are re-encoded for it."""
    micro_batch_size_per_gpu: int = 8
    """Sequences per reward-model forward on one DP rank."""
    max_length: int = 0
    """Longest re-encoded input (tokens, kept from the end); 0: data.max_prompt_length + max_response_length."""
    offload_params: bool = False
    """Keep the reward model's weights on the host except while it scores (hybrid engine)."""
    combine: str = "replace"
    """replace: the reward is the RM score; add: RM score + the rule score of the row's data_source."""
    train: RewardModelTrainConfig = field(default_factory=RewardModelTrainConfig)
    """scripts/train_rm.py settings."""

    def __post_init__(self):
        one_of("reward_model.combine", self.combine, REWARD_COMBINE_MODES)
        check(self.micro_batch_size_per_gpu >= 1, "reward_model.micro_batch_size_per_gpu must be >= 1")
        check(self.max_length >= 0, "reward_model.max_length must be >= 0 (0: prompt + response length)")
        check(not self.enable or bool(self.path),
               "reward_model.enable=true needs reward_model.path: an HF *ForSequenceClassification folder "
               "(scripts/train_rm.py --config <this config> writes one there)")
