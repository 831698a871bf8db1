"""Section algorithm: advantage estimator, KL control, rollout correction and dynamic sampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from hybridrl.config.checks import check, one_of


ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "grpo_passk",
                  "opo", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo")
ESTIMATOR_ALIASES = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
"""verl's vectorized implementations of the same estimators (the same advantages): read as those."""
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = KL_KINDS + tuple(k + "+" for k in KL_KINDS)
"""The estimators; with "+", verl's straight-through form (the estimator's value, k2's gradient)."""


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


IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
ASYNC_ROLLOUT_IS = "token"
"""What rollout_is becomes when async training lags the engine and the user did not set it (verl's advice)."""
Threshold = Union[float, int, str]


def _threshold_parts(key: str, value) -> None:
    """Each comma-separated entry a positive number or (IcePop / k1 options) 'lower_upper' of two."""
    for part in str(value).split(","):
        numbers = part.strip().split("_")
        ok = len(numbers) <= 2 and all(_positive(x) for x in numbers)
        check(ok, f"{key}={value!r}: each entry must be a positive number or 'lower_upper', e.g. 2.0 or 0.5_5.0")


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl 0.9.1's algorithm.rollout_correction: the engine's log-probs (pi_rollout) against the trainer's
    (pi_old); presets as recipes in configs/recipes/."""
    rollout_is: Optional[str] = None
    """Importance weights pi_old / pi_rollout on the policy loss: null (none), token or sequence (the row's
    product). Default with async_training.staleness_threshold >= 1 or partial_rollout: token (at 2.0)."""
    rollout_is_threshold: Threshold = 2.0
    """A number truncates the weights there (TIS); "lower_upper" (e.g. 0.5_5.0) zeroes them outside (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (over tokens; over rows for sequence)."""
    rollout_rs: Optional[str] = None
    """Rejection: comma-separated options, each token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 or
    seq_max_k2/k3 (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r); rejected tokens leave the loss."""
    rollout_rs_threshold: Optional[Threshold] = None
    """One bound per rollout_rs option (comma-separated) or one for all: an upper bound for k2 / k3, ratio
    bounds "lower_upper" for k1 (a single number u means 1/u_u)."""
    bypass_mode: bool = False
    """The engine's log-probs are the old log-probs (no old-log-prob pass); the correction then measures the
    current policy against the engine inside the loss."""
    loss_type: str = "ppo_clip"
    """Bypass mode's policy loss: ppo_clip (actor.policy_loss.loss_mode against the engine; IS weights only
    measured) or reinforce (-A log pi times the IS weights, no clip)."""

    def __post_init__(self):
        key = "algorithm.rollout_correction"
        check(self.rollout_is is None or self.rollout_is in IS_LEVELS,
              f"{key}.rollout_is={self.rollout_is!r} is not one of null, {', '.join(IS_LEVELS)}")
        _threshold_parts(f"{key}.rollout_is_threshold", self.rollout_is_threshold)
        check("," not in str(self.rollout_is_threshold), f"{key}.rollout_is_threshold takes one entry")
        one_of(f"{key}.loss_type", self.loss_type, ("ppo_clip", "reinforce"))
        if self.rollout_rs is None:
            return
        options = [o.strip() for o in self.rollout_rs.split(",") if o.strip()]
        bad = [o for o in options if o not in RS_OPTIONS]
        check(options and not bad, f"{key}.rollout_rs={self.rollout_rs!r}: unknown option(s) {bad}; valid: "
                                   f"{', '.join(RS_OPTIONS)}, comma separated")
        check(self.rollout_rs_threshold is not None,
              f"{key}.rollout_rs={self.rollout_rs} needs {key}.rollout_rs_threshold (e.g. 0.01 for seq_mean_k3, "
              "0.5_2.0 for a k1 option)")
        _threshold_parts(f"{key}.rollout_rs_threshold", self.rollout_rs_threshold)

    @property
    def corrects(self) -> bool:
        """Whether the loss changes (IS weights or rejection), beyond the rollout_corr/ metrics."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def kwargs(self) -> dict:
        """The arguments of algos.compute_rollout_correction_and_rejection_mask."""
        return dict(rollout_is=self.rollout_is, rollout_is_threshold=self.rollout_is_threshold,
                    rollout_is_batch_normalize=self.rollout_is_batch_normalize, rollout_rs=self.rollout_rs,
                    rollout_rs_threshold=self.rollout_rs_threshold)


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, generate more until the batch is full."""
    metric: str = "reward"
    """Per-response value compared within a group: reward (verl 0.9.1's default: the score after overlong shaping,
    what the advantages see before any KL; seq_reward is the same), score (before shaping), acc (the reward's acc,
    else its score), or a numeric key returned by the custom reward function."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before stopping with an error; <= 0: no limit."""

    def __post_init__(self):
        check(bool(self.metric), "algorithm.filter_groups.metric must name a value, e.g. acc")


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """gae (PPO with critic; verl's default), grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax,
    grpo_passk, opo, gpg (grpo_vectorized / rloo_vectorized read as grpo / rloo), optimal_token_baseline (a baseline
    per group and time step weighted by the old policy's path variance: it runs an old-log-prob pass, which also
    gives sum pi^2; not with rollout_correction.bypass_mode), tir_optimal_token_baseline (the same with the time
    step counted in each response's own tokens: multi-turn trajectories with tool output inside), gdpo (each
    reward component of gdpo_reward_keys normalised within its group apart, then summed and whitened)."""
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
    """The engine-vs-trainer mismatch: importance sampling, rejection, bypass mode (verl's keys)."""
    gdpo_reward_keys: Optional[List[str]] = None
    """GDPO: the keys of the reward function's dict whose values are normalised apart (e.g. [format_reward,
    accuracy_reward]); every response's must be a number."""
    gdpo_reward_weights: Optional[List[float]] = None
    """GDPO: one weight per key in the sum (null: equal weights)."""

    def __post_init__(self):
        object.__setattr__(self, "adv_estimator", ESTIMATOR_ALIASES.get(self.adv_estimator, self.adv_estimator))
        one_of("algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        one_of("algorithm.kl_penalty", self.kl_penalty, KL_KINDS)
        check(self.adv_estimator != "gdpo" or bool(self.gdpo_reward_keys),
              "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the keys of the reward function's dict "
              "to normalise apart, e.g. [format_reward, accuracy_reward]")
        check(self.gdpo_reward_weights is None or len(self.gdpo_reward_weights) == len(self.gdpo_reward_keys or []),
              f"algorithm.gdpo_reward_weights has {len(self.gdpo_reward_weights or [])} weights for "
              f"{len(self.gdpo_reward_keys or [])} algorithm.gdpo_reward_keys: give one per key, or null")
        check(not self.adv_estimator.endswith("optimal_token_baseline") or not self.rollout_correction.bypass_mode,
              f"algorithm.adv_estimator={self.adv_estimator} needs the old policy's sum pi^2 from an old-log-prob "
              "pass, which algorithm.rollout_correction.bypass_mode=true skips: set bypass_mode=false")

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator == "gae"
