"""The typed configuration tree: one frozen dataclass per section, every field with a default and a doc.

Sections live one file each (model: data/model/parallel; training: actor/critic/ref; rollout; algorithm;
reward: reward/reward_model; run: trainer/sft; placement: placement/async_training), each validated in its `__post_init__`, and `tree.Config`
holds them all; this package's namespace is that tree. `io` turns YAML plus dotted overrides into a Config
(OmegaConf stops there), `layout` checks the rules that span sections and derives the sizes of a run once,
and `batching` resolves each pass's micro-batching. Nothing here imports another hybridrl package: the
config is the floor every other package stands on.
"""
from hybridrl.config.algorithm import (ADV_ESTIMATORS, KL_KINDS, AlgorithmConfig, FilterGroupsConfig, KLControlConfig,
                                       RolloutCorrectionConfig)
from hybridrl.config.checks import ConfigError
from hybridrl.config.model import DataConfig, ModelConfig, ParallelConfig
from hybridrl.config.placement import PLACEMENT_MODES, AsyncTrainingConfig, PlacementConfig
from hybridrl.config.reward import (REWARD_COMBINE_MODES, CustomRewardConfig, OverlongBufferConfig, RewardConfig,
                                    RewardModelConfig, RewardModelTrainConfig)
from hybridrl.config.rollout import MultiTurnConfig, RolloutConfig, ValKwargsConfig
from hybridrl.config.run import SFTConfig, TrainerConfig
from hybridrl.config.training import (LOSS_AGG_MODES, POLICY_LOSS_MODES, ActorConfig, CriticConfig, OffloadConfig,
                                      OptimConfig, PolicyLossConfig, RefConfig)
from hybridrl.config.tree import Config

__all__ = ["ADV_ESTIMATORS", "KL_KINDS", "LOSS_AGG_MODES", "POLICY_LOSS_MODES", "REWARD_COMBINE_MODES",
           "ActorConfig", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "CustomRewardConfig",
           "DataConfig", "FilterGroupsConfig", "KLControlConfig", "ModelConfig", "MultiTurnConfig", "OffloadConfig",
           "OptimConfig", "OverlongBufferConfig", "PLACEMENT_MODES", "AsyncTrainingConfig", "PlacementConfig",
           "ParallelConfig", "PolicyLossConfig", "RefConfig", "RewardConfig",
           "RewardModelConfig", "RewardModelTrainConfig", "RolloutConfig", "RolloutCorrectionConfig", "SFTConfig",
           "TrainerConfig", "ValKwargsConfig"]
