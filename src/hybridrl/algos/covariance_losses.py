"""The Clip-Cov and KL-Cov policy losses of "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models" (Cui et al. 2025), as verl 0.9.1 registers them (clip_cov, kl_cov).

Both act on the few tokens whose centred advantage times centred log-prob (their contribution to the
covariance that drives entropy down) is largest, so that entropy does not collapse: Clip-Cov drops the
gradient of a random `ratio` share of the tokens whose covariance lies in (lb, ub), KL-Cov adds a
|log-ratio| penalty to the top `ratio` share. The statistics are over the batch given (a micro-batch in
training, as verl's); Clip-Cov draws from torch's global generator.
"""
from typing import Dict, Optional, Tuple

import torch

from hybridrl.algos.aggregation import agg_loss
from hybridrl.algos.masked import _mask_like, masked_mean

Tensor = torch.Tensor


def _covariance(advantages: Tensor, log_prob: Tensor, m: Tensor) -> Tensor:
    """(A - mean A) * (log pi - mean log pi) per token, means over the loss tokens."""
    return (advantages - masked_mean(advantages, m)) * (log_prob - masked_mean(log_prob.detach(), m))


def clip_cov_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                         clip_low: float = 0.2, clip_high: float = 0.2, cov_ratio: float = 2e-4,
                         cov_lb: float = 1.0, cov_ub: float = 5.0, agg_mode: str = "token-mean",
                         rollout_is_weights: Optional[Tensor] = None,
                         loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO's clipped surrogate (no dual clip), with max(1, cov_ratio * tokens) tokens drawn at random among
    those not clipped by PPO whose covariance is in (cov_lb, cov_ub) contributing no loss (and no gradient);
    pg_clipfrac is the share of those tokens."""
    if cov_ratio <= 0:
        raise ValueError(f"clip_cov needs actor.policy_loss.clip_cov_ratio > 0, got {cov_ratio}")
    m = _mask_like(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    valid = m > 0
    cov = _covariance(advantages, log_prob, m).detach()
    candidates = torch.nonzero((cov > cov_lb) & (cov < cov_ub) & valid & ~(losses2 > losses1))
    keep = torch.ones_like(advantages)
    if len(candidates):
        count = min(max(int(cov_ratio * m.sum().item()), 1), len(candidates))
        chosen = candidates[torch.randperm(len(candidates))[:count]]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    losses = torch.maximum(losses1, losses2) * keep
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    stats = {"pg_clipfrac": masked_mean((keep == 0).to(m.dtype), m), "ppo_kl": masked_mean(-log_ratio, m)}
    return agg_loss(losses, m, agg_mode, loss_scale_factor), {k: v.detach() for k, v in stats.items()}


def kl_cov_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                       cov_ratio: float = 2e-4, kl_coef: float = 1.0, agg_mode: str = "token-mean",
                       rollout_is_weights: Optional[Tensor] = None,
                       loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The unclipped surrogate -A * ratio, plus kl_coef * |log ratio| on the max(1, cov_ratio * tokens) loss
    tokens of largest covariance (torch.topk's picks); ppo_kl is the mean |log ratio|, as verl reports it."""
    if cov_ratio <= 0:
        raise ValueError(f"kl_cov needs actor.policy_loss.kl_cov_ratio > 0, got {cov_ratio}")
    m = _mask_like(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    losses = -advantages * torch.exp(log_ratio)
    valid = (m > 0).reshape(-1)
    if valid.any():
        flat = torch.nonzero(valid).reshape(-1)
        adv, logp = advantages.detach().reshape(-1)[flat], log_prob.detach().reshape(-1)[flat]
        cov = (adv - adv.mean()) * (logp - logp.mean())
        top = flat[torch.topk(cov.cpu(), max(1, int(len(cov) * cov_ratio))).indices.to(flat.device)]
        penalised = torch.zeros_like(valid)
        penalised[top] = True
        losses = torch.where(penalised.view_as(m), losses + kl_coef * log_ratio.abs(), losses)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    return (agg_loss(losses, m, agg_mode, loss_scale_factor),
            {"ppo_kl": masked_mean(log_ratio.abs(), m).detach()})
