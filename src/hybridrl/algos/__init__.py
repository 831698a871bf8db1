"""RL math for LLM post-training: advantages, losses, KL penalties, KL controllers, and (from
`rollout_correction`) verl 0.9.1's importance sampling and rejection of the engine-vs-trainer mismatch;
`masked` holds the masked statistics they share.

Everything here is pure tensor math on one process: tensors in, tensors out,
deterministic, dtype-preserving (float32 and float64). Conventions follow verl's
``core_algos``: masks are [B, T] (float or bool) over right-padded responses,
per-sequence scores are [B]. This package must never call torch.distributed nor import
another hybridrl package: callers reduce across ranks themselves, so the same code serves the
driver, workers and tests.
"""

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from hybridrl.algos.aggregation import LOSS_AGG_MODES, agg_loss, agg_loss_denominator
from hybridrl.algos.group_estimators import (GroupIndex, _group_mean_std, compute_gpg_advantages,
                                             compute_grpo_passk_advantages, compute_opo_advantages,
                                             compute_optimal_token_baseline_advantages,
                                             compute_tir_optimal_token_baseline_advantages)
from hybridrl.algos.masked import WHITEN_EPS, _mask_like, masked_mean, masked_sum, masked_var, masked_whiten
from hybridrl.algos.rollout_correction import (compute_rollout_correction_and_rejection_mask,
                                               rollout_probs_diff_metrics)

Tensor = torch.Tensor

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = KL_KINDS + tuple(k + "+" for k in KL_KINDS)  # "+": straight-through (kl_penalty)


# ----------------------------------------------------------------------------- advantage estimators


def gae_returns(token_rewards: Tensor, values: Tensor, response_mask: Tensor,
                gamma: float, lam: float) -> Tuple[Tensor, Tensor]:
    """GAE (Schulman et al.) per token, each row on its own: (raw advantages, returns = raw + values)."""
    m = _mask_like(response_mask, values)
    B, T = values.shape
    next_value = values.new_zeros(B)
    last_gae = values.new_zeros(B)
    reversed_adv = []
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # Masked tokens (padding, tool output) are skipped: the recursion carries
        # the state of the next valid token straight through them.
        next_value = torch.where(m[:, t] != 0, values[:, t], next_value)
        last_gae = torch.where(m[:, t] != 0, gae_t, last_gae)
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values  # value targets use the raw advantages


def compute_gae_advantages(token_rewards: Tensor, values: Tensor, response_mask: Tensor,
                           gamma: float, lam: float) -> Tuple[Tensor, Tensor]:
    """GAE per token; returns (advantages whitened over the batch * mask, returns)."""
    advantages, returns = gae_returns(token_rewards, values, response_mask, gamma, lam)
    m = _mask_like(response_mask, values)
    return masked_whiten(advantages, m) * m, returns


def compute_grpo_advantages(scores: Tensor, response_mask: Tensor, group_index: GroupIndex,
                            eps: float = 1e-6, norm_by_std: bool = True) -> Tuple[Tensor, Tensor]:
    """GRPO: outcome score relative to its group (optionally / group std), on every token."""
    mean, std, _ = _group_mean_std(scores, group_index)
    adv = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    adv = adv[:, None] * _mask_like(response_mask, scores)
    return adv, adv


def compute_gdpo_advantages(components: Sequence[Tensor], response_mask: Tensor, group_index: GroupIndex,
                            weights: Optional[Sequence[float]] = None, norm_by_std: bool = True,
                            eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    """GDPO (arXiv 2601.05242, verl's gdpo): each reward component [B] normalised within its group apart, as GRPO
    normalises the score (so a large component does not drown a small one), their weighted sum (equal weights by
    default), whitened over the batch's loss tokens."""
    weights = [1.0] * len(components) if weights is None else list(weights)
    if len(weights) != len(components):
        raise ValueError(f"{len(weights)} GDPO weights for {len(components)} reward components")
    m = _mask_like(response_mask, components[0])
    total = sum(w * compute_grpo_advantages(c, response_mask, group_index, eps, norm_by_std)[0]
                for w, c in zip(weights, components))
    adv = masked_whiten(total, m) * m
    return adv, adv


def compute_rloo_advantages(scores: Tensor, response_mask: Tensor,
                            group_index: GroupIndex) -> Tuple[Tensor, Tensor]:
    """RLOO: score minus the mean of the other samples of its group."""
    mean, _, n = _group_mean_std(scores, group_index)
    # s - mean_{-i} == (s - mean) * n / (n - 1); a singleton has no baseline.
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
    adv = torch.where(n > 1, (scores - mean) * scale, scores)
    adv = adv[:, None] * _mask_like(response_mask, scores)
    return adv, adv


def compute_reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor,
                                    gamma: float) -> Tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go over the model's tokens, whitened over the batch.

    As verl 0.9.1: a masked token (tool output inside a trajectory, padding) stores 0 and carries the
    running return through unchanged, so a reward after a tool result still reaches the turns before it."""
    m = _mask_like(response_mask, token_rewards)
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        step = token_rewards[:, t] + gamma * running
        returns[:, t] = step * m[:, t]
        running = torch.where(m[:, t] != 0, step, running)
    return masked_whiten(returns, m) * m, returns


def compute_reinforce_pp_baseline_advantages(scores: Tensor, response_mask: Tensor,
                                             group_index: GroupIndex) -> Tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: group-mean baseline, then whitening over the batch mask."""
    m = _mask_like(response_mask, scores)
    mean, _, _ = _group_mean_std(scores, group_index)
    adv = (scores - mean)[:, None] * m
    adv = masked_whiten(adv, m) * m
    return adv, adv


def compute_remax_advantages(token_rewards: Tensor, baseline_scores: Tensor,
                             response_mask: Tensor) -> Tuple[Tensor, Tensor]:
    """ReMax: undiscounted return-to-go minus the greedy rollout's score."""
    m = _mask_like(response_mask, token_rewards)
    returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
    advantages = returns - baseline_scores.to(token_rewards.dtype)[:, None] * m
    return advantages, returns


ADV_ESTIMATORS: Dict[str, Callable] = {
    "gae": compute_gae_advantages,
    "grpo": compute_grpo_advantages,
    "rloo": compute_rloo_advantages,
    "reinforce_plus_plus": compute_reinforce_pp_advantages,
    "reinforce_plus_plus_baseline": compute_reinforce_pp_baseline_advantages,
    "remax": compute_remax_advantages,
    "grpo_passk": compute_grpo_passk_advantages,
    "opo": compute_opo_advantages,
    "gpg": compute_gpg_advantages,
    "optimal_token_baseline": compute_optimal_token_baseline_advantages,
    "tir_optimal_token_baseline": compute_tir_optimal_token_baseline_advantages,
    "gdpo": compute_gdpo_advantages,
}
TOKEN_STAT_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
"""Estimators that read the old policy's per-token statistics (old log-probs, sum pi^2): they need an old-log-prob
pass before the advantages."""


def get_adv_estimator(name: str) -> Callable:
    """Look up an advantage estimator by its config name."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def compute_advantages(name: str, *, token_rewards: Optional[Tensor] = None, scores: Optional[Tensor] = None,
                       values: Optional[Tensor] = None, response_mask: Tensor,
                       group_index: Optional[GroupIndex] = None, gamma: float = 1.0, lam: float = 1.0,
                       norm_by_std: bool = True, baseline_scores: Optional[Tensor] = None,
                       old_log_probs: Optional[Tensor] = None, sum_pi_squared: Optional[Tensor] = None,
                       rollout_is_weights: Optional[Tensor] = None, components: Optional[Sequence[Tensor]] = None,
                       component_weights: Optional[Sequence[float]] = None) -> Tuple[Tensor, Tensor]:
    """Uniform entry point: pass everything you have, the estimator takes what it needs.

    scores default to token_rewards.sum(-1) (outcome reward of each sequence).
    """
    get_adv_estimator(name)  # validate the name first
    if scores is None and token_rewards is not None:
        scores = (token_rewards * _mask_like(response_mask, token_rewards)).sum(-1)

    def need(**kw):
        missing = [k for k, v in kw.items() if v is None]
        if missing:
            raise ValueError(f"advantage estimator {name!r} needs {', '.join(missing)}")

    if name == "gae":
        need(token_rewards=token_rewards, values=values)
        return compute_gae_advantages(token_rewards, values, response_mask, gamma, lam)
    if name == "reinforce_plus_plus":
        need(token_rewards=token_rewards)
        return compute_reinforce_pp_advantages(token_rewards, response_mask, gamma)
    if name == "remax":
        need(token_rewards=token_rewards, baseline_scores=baseline_scores)
        return compute_remax_advantages(token_rewards, baseline_scores, response_mask)
    if name == "gdpo":
        need(components=components, group_index=group_index)
        # each component divided by its group's std whatever norm_by_std says: the method's decoupled normalisation
        # (verl's trainer does not pass norm_adv_by_std_in_grpo to it either)
        return compute_gdpo_advantages(components, response_mask, group_index, component_weights)
    if name in TOKEN_STAT_ESTIMATORS:
        need(token_rewards=token_rewards, group_index=group_index, old_log_probs=old_log_probs,
             sum_pi_squared=sum_pi_squared)
        return ADV_ESTIMATORS[name](token_rewards, response_mask, group_index, old_log_probs, sum_pi_squared,
                                    rollout_is_weights)
    need(scores=scores, group_index=group_index)
    if name in ("grpo", "grpo_passk"):
        return ADV_ESTIMATORS[name](scores, response_mask, group_index, norm_by_std=norm_by_std)
    return ADV_ESTIMATORS[name](scores, response_mask, group_index)


def token_rewards_from_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """[B] scores -> [B, T] rewards with each score on its row's last valid token."""
    valid = _mask_like(response_mask, scores) != 0
    pos = torch.arange(valid.shape[1], device=valid.device)
    # Last nonzero column (== length - 1 for right padding); empty rows get nothing.
    last = torch.where(valid, pos, torch.zeros_like(pos)).argmax(dim=1)
    out = torch.zeros(valid.shape, dtype=scores.dtype, device=scores.device)
    out[torch.arange(valid.shape[0], device=valid.device), last] = scores * valid.any(dim=1)
    return out


# ----------------------------------------------------------------------------- losses


def policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                agg_mode: str = "token-mean", rollout_is_weights: Optional[Tensor] = None,
                loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Dual-clip PPO surrogate (clip-higher capable), verl's "vanilla"; each token's loss times its
    rollout IS weight when given (`compute_rollout_correction_and_rejection_mask`: pi_old / pi_rollout)."""
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")
    m = _mask_like(response_mask, log_prob)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)  # exp stays finite
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip1 = torch.maximum(losses1, losses2)
    # Dual clip: with A < 0 a huge ratio would give an unbounded loss; cap it at -A*c.
    losses3 = -advantages * clip_c
    clip2 = torch.minimum(losses3, clip1)
    negative = advantages < 0
    losses = torch.where(negative, clip2, clip1)
    lower = masked_mean(((clip1 > losses3) & negative).to(m.dtype), m)
    return _surrogate_result(losses, losses1, losses2, log_ratio, m, lower, rollout_is_weights, agg_mode,
                             loss_scale_factor)


def _surrogate_result(losses: Tensor, losses1: Tensor, losses2: Tensor, log_ratio: Tensor, m: Tensor,
                      clipfrac_lower: Tensor, is_weights: Optional[Tensor], agg_mode: str,
                      loss_scale_factor: Optional[float]) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The aggregated loss of a clipped surrogate (times the rollout IS weights, if any) and its stats."""
    if is_weights is not None:
        losses = losses * is_weights
    stats = {
        "pg_clipfrac": masked_mean((losses2 > losses1).to(m.dtype), m),
        "ppo_kl": masked_mean(-log_ratio, m),
        "pg_clipfrac_lower": clipfrac_lower,
    }
    return agg_loss(losses, m, agg_mode, loss_scale_factor), {k: v.detach() for k, v in stats.items()}


def gspo_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                     clip_low: float = 3e-4, clip_high: float = 4e-4, agg_mode: str = "seq-mean-token-mean",
                     rollout_is_weights: Optional[Tensor] = None,
                     loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, verl's "gspo"): one clipped importance ratio per sequence.

    s_i = exp(mean_t log(pi / pi_old)) over the row's loss tokens. Every token carries the value
    s_i, with the gradient of its own log-prob scaled by s_i (s_i * pi_t / sg(pi_t)); the PPO clip
    applies to s_i, so its ranges are small (verl's GSPO recipe: 3e-4 / 4e-4). No dual clip.
    """
    m = _mask_like(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, m, dim=-1) / m.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(losses1, losses2)
    no_dual_clip = torch.zeros((), dtype=m.dtype, device=m.device)
    return _surrogate_result(losses, losses1, losses2, log_ratio, m, no_dual_clip, rollout_is_weights, agg_mode,
                             loss_scale_factor)


def reinforce_policy_loss(rollout_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                          agg_mode: str = "seq-mean-token-sum", rollout_is_weights: Optional[Tensor] = None,
                          loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """REINFORCE, verl's bypass-mode loss_type "reinforce": -A * log pi per token (times the IS weight
    pi / pi_rollout when given, held constant), no ratio and no clip; ppo_kl is KL(pi_rollout || pi)."""
    m = _mask_like(response_mask, log_prob)
    losses = -advantages * log_prob
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    stats = {"ppo_kl": masked_mean(rollout_log_prob - log_prob, m).detach()}
    return agg_loss(losses, m, agg_mode, loss_scale_factor), stats


def bypass_mode_policy_loss(rollout_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                            loss_type: str = "ppo_clip", correction: Optional[Dict] = None,
                            surrogate: Callable = policy_loss, agg_mode: str = "token-mean",
                            loss_scale_factor: Optional[float] = None):
    """verl's bypass mode (old log-probs = the engine's): the correction of the current policy against the
    engine (`correction`: the keyword arguments of compute_rollout_correction_and_rejection_mask) rejects
    tokens, then ppo_clip runs `surrogate` (policy_loss or gspo_policy_loss with its clip ranges bound: the PPO
    ratio pi / pi_rollout is the IS correction, the weights are only measured) or reinforce applies the weights.
    Returns (loss, stats, rollout_corr/ metrics, mask after rejection)."""
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"loss_type must be ppo_clip or reinforce, got {loss_type!r}")
    with torch.no_grad():
        weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
            log_prob.detach(), rollout_log_prob, response_mask, **(correction or {}))
    common = dict(agg_mode=agg_mode, loss_scale_factor=loss_scale_factor)
    if loss_type == "reinforce":
        loss, stats = reinforce_policy_loss(rollout_log_prob, log_prob, advantages, mask, rollout_is_weights=weights,
                                            **common)
    else:
        loss, stats = surrogate(rollout_log_prob, log_prob, advantages, mask, **common)
    return loss, stats, metrics, mask


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor,
               clip: float = 0.5, agg_mode: str = "token-mean",
               loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Clipped value loss 0.5*max((v-R)^2, (v_clip-R)^2); returns (loss, clipfrac)."""
    m = _mask_like(response_mask, values)
    # Inside the clip range v_clipped must be v itself: old + (v - old) is not bit-equal to v, and
    # that rounding would flip the clipfrac comparison at random.
    delta = values - old_values
    v_clipped = torch.where(delta.abs() > clip, old_values + torch.clamp(delta, -clip, clip), values)
    losses1 = (values - returns) ** 2
    losses2 = (v_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(losses1, losses2), m, agg_mode, loss_scale_factor)
    return loss, masked_mean((losses2 > losses1).to(m.dtype), m).detach()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp - E_p[logit]."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_loss(entropy: Tensor, mask: Tensor, agg_mode: str = "token-mean",
                 loss_scale_factor: Optional[float] = None) -> Tensor:
    """Aggregated token entropy (the caller subtracts coeff * this from the loss)."""
    return agg_loss(entropy, mask, agg_mode, loss_scale_factor)


# ----------------------------------------------------------------------------- KL


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled log-probs (Schulman's k1/k2/k3). A kind ending in "+"
    (verl's straight-through variants, e.g. "k3+") has that estimator's value and k2's gradient, whose
    expectation is the gradient of the KL (k1's and k3's are not)."""
    if kind.endswith("+"):
        value = _kl_estimate(log_prob, ref_log_prob, kind[:-1])
        k2 = 0.5 * (log_prob - ref_log_prob).square()
        return k2 - k2.detach() + value.detach()
    return _kl_estimate(log_prob, ref_log_prob, kind)


def _kl_estimate(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    diff = log_prob - ref_log_prob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        # k3 = r - log r - 1 with r = pi_ref/pi: unbiased, >= 0, low variance.
        kl = torch.clamp(-diff, -20.0, 20.0)
        return torch.clamp(torch.exp(kl) - kl - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown kl penalty {kind!r}; valid: {', '.join(KL_KINDS)}")


def apply_kl_penalty(token_level_scores: Tensor, log_prob: Tensor, ref_log_prob: Tensor,
                     response_mask: Tensor, kl_coef: float, kind: str) -> Tuple[Tensor, Tensor]:
    """KL-in-reward: rewards = scores - coef * kl; also the batch mean of per-row mean KL.

    A fully masked row has mean KL 0 and still counts in the batch mean.
    """
    m = _mask_like(response_mask, token_level_scores)
    kl = kl_penalty(log_prob, ref_log_prob, kind).to(token_level_scores.dtype) * m
    rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, m, dim=-1).mean()
    return rewards, current_kl.detach()


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the coefficient so the observed KL tracks target_kl."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl, n_steps: int) -> None:
        # Error is clipped to +-20% so one noisy batch cannot swing the coefficient.
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, kl_coef: float, target_kl: Optional[float] = None,
                       horizon: Optional[int] = None):
    """Build the KL controller named by algorithm.kl_ctrl.type ("fixed" or "adaptive")."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl controller {kind!r}; valid: fixed, adaptive")
