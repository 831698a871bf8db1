"""Section algorithm: advantage estimator, KL control, rollout correction and dynamic sampling."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.checks import check, one_of


ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclass(frozen=True)
class KLControlConfig:
    type: str = "fixed"
    """fixed or adaptive KL coefficient."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient of the reward penalty."""
    target_kl: float = 0.1
    """Adaptive controller target."""
    horizon: int = 10000
    """Adaptive controller horizon."""

    def __post_init__(self):
        one_of("algorithm.kl_ctrl.type", self.type, ("fixed", "adaptive"))


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    bypass_mode: bool = False
    """verl's bypass mode (loss_type ppo_clip): the rollout engine's log-probs are the old log-probs,
    so no separate old-log-prob pass runs; the PPO ratio is then actor / rollout engine."""


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, generate more until the batch is full."""
    metric: str = "acc"
    """Per-response value compared within a group: acc / score (before overlong shaping), seq_reward (after),
    or a numeric key returned by the custom reward function."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before stopping with an error; <= 0: no limit."""

    def __post_init__(self):
        check(bool(self.metric), "algorithm.filter_groups.metric must name a value, e.g. acc")


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """gae (PPO with critic), grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide group-relative advantages by the group std."""
    use_kl_in_reward: bool = False
    """Subtract coef * KL(actor || ref) from token rewards."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of the reward-penalty coefficient."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Where the old log-probs come from when the engine's may stand in for them."""

    def __post_init__(self):
        one_of("algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        one_of("algorithm.kl_penalty", self.kl_penalty, KL_KINDS)

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator == "gae"
