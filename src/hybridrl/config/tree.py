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
        check(not self.trainer.val_only or bool(self.data.val_files),
              "trainer.val_only=true validates and stops: set data.val_files to the prompts to validate on")
