"""The root of the typed config tree: one field per section."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.algorithm import AlgorithmConfig
from hybridrl.config.checks import check
from hybridrl.config.model import DataConfig, ModelConfig, ParallelConfig
from hybridrl.config.placement import AsyncTrainingConfig, PlacementConfig
from hybridrl.config.reward import RewardConfig, RewardModelConfig
from hybridrl.config.rollout import RolloutConfig
from hybridrl.config.run import SFTConfig, TrainerConfig
from hybridrl.config.training import ActorConfig, CriticConfig, RefConfig

@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)

    def __post_init__(self):
        # the critic's unset batch and loss settings are the actor's, as verl's config interpolates them
        object.__setattr__(self, "critic", self.critic.inheriting(self.actor))
        check(self.algorithm.adv_estimator != "grpo_passk" or self.rollout.n >= 2,
              "algorithm.adv_estimator=grpo_passk compares each prompt's best two responses: set rollout.n >= 2")
        for key, mine, data_key in (("prompt_length", self.rollout.prompt_length, "max_prompt_length"),
                                    ("response_length", self.rollout.response_length, "max_response_length")):
            check(mine is None or mine == getattr(self.data, data_key),
                  f"rollout.{key}={mine} differs from data.{data_key}={getattr(self.data, data_key)}: verl's YAML "
                  f"copies data.{data_key} there; set data.{data_key} (and drop rollout.{key})")
        check(not self.trainer.val_only or bool(self.data.val_files),
              "trainer.val_only=true validates and stops: set data.val_files to the prompts to validate on")
