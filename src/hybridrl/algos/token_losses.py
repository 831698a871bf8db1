"""Policy losses beside PPO's clipped token surrogate, as verl 0.9.1 registers them: CISPO, GPG, DRO, GMPO
(geo_mean), SAPO and DPPO (dppo_tv, dppo_kl).

Each takes (old log-probs, log-probs, advantages, response mask) [B, T] and the aggregation of
`hybridrl.algos.aggregation`, multiplies each token's loss by its rollout IS weight where given (the
trainer's rollout correction), and returns (the aggregated loss, detached token statistics).
"""
from typing import Dict, Optional, Tuple

import torch

from hybridrl.algos.aggregation import agg_loss
from hybridrl.algos.masked import _mask_like, masked_mean

Tensor = torch.Tensor


def _aggregate(losses: Tensor, m: Tensor, is_weights: Optional[Tensor], agg_mode: str,
               loss_scale_factor: Optional[float]) -> Tensor:
    return agg_loss(losses * is_weights if is_weights is not None else losses, m, agg_mode, loss_scale_factor)


def cispo_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                      clip_low: float = 0.2, clip_high: float = 0.2, agg_mode: str = "token-mean",
                      rollout_is_weights: Optional[Tensor] = None,
                      loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(ratio, 1 - low, 1 + high)) * A * log pi per token. The clipped
    importance weight is a constant, so every token keeps its gradient (PPO's clip drops a clipped token's);
    pg_clipfrac counts the tokens whose weight was clipped."""
    m = _mask_like(response_mask, log_prob)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = -weight.detach() * advantages * log_prob
    stats = {"pg_clipfrac": masked_mean((ratio != weight).to(m.dtype), m), "ppo_kl": masked_mean(-log_ratio, m),
             "pg_clipfrac_lower": torch.zeros((), dtype=m.dtype, device=m.device)}
    return (_aggregate(losses, m, rollout_is_weights, agg_mode, loss_scale_factor),
            {k: v.detach() for k, v in stats.items()})


def gpg_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                    agg_mode: str = "token-mean", rollout_is_weights: Optional[Tensor] = None,
                    loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GPG (Chu et al. 2025): the plain policy gradient, -A * log pi per token; no ratio, no clip, no statistics
    (verl's returns none)."""
    m = _mask_like(response_mask, log_prob)
    return _aggregate(-log_prob * advantages, m, rollout_is_weights, agg_mode, loss_scale_factor), {}


def dro_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                    beta: float = 0.0, agg_mode: str = "token-mean", rollout_is_weights: Optional[Tensor] = None,
                    loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """DRO (direct reward optimisation): -(A * log pi - beta / 2 * (log pi - log pi_old)^2) per token, a
    policy gradient held near the old policy by a quadratic penalty on the log-ratio (beta > 0)."""
    if beta <= 0:
        raise ValueError(f"DRO needs actor.policy_loss.dro_beta > 0, got {beta}")
    m = _mask_like(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    return (_aggregate(losses, m, rollout_is_weights, agg_mode, loss_scale_factor),
            {"ppo_kl": masked_mean(-log_ratio, m).detach()})


GEO_MEAN_AGG = "seq-mean-token-mean"
"""GMPO's loss is a mean over responses whatever actor.loss_agg_mode says (verl: "not used")."""


def geo_mean_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                         clip_low: float = 0.2, clip_high: float = 0.2, agg_mode: str = GEO_MEAN_AGG,
                         rollout_is_weights: Optional[Tensor] = None,
                         loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, verl's geo_mean): per response, -A * exp(mean over its tokens of the log-ratio
    clipped PPO's way in log space, sign(A) * min(sign(A) * r, sign(A) * clip(r, -low, high))), A the
    response's mean advantage; IS weights enter as their geometric mean over the response. The mean over the
    responses that have a loss token (rows without one add 0; the trainer's share divides by every row of the
    mini-batch, as verl's torch.mean). agg_mode is not read."""
    m = _mask_like(response_mask, log_prob)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_low, clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    length = m.sum(dim=-1) + 1e-8
    row_loss = -(advantages * m).sum(dim=-1) / length * torch.exp((kept * m).sum(dim=-1) / length)
    if rollout_is_weights is not None:
        row_loss = row_loss * torch.exp((torch.log(rollout_is_weights + 1e-10) * m).sum(dim=-1) / length)
    rows = (m.sum(dim=-1) > 0).to(m.dtype)
    clipped = (log_ratio != clamped).to(m.dtype)
    stats = {"pg_clipfrac": masked_mean(clipped * (advantages > 0), m), "ppo_kl": masked_mean(-log_ratio, m),
             "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), m)}
    return row_loss.sum() / rows.sum().clamp(min=1), {k: v.detach() for k, v in stats.items()}


SAPO_AGG = "seq-mean-token-mean"
"""SAPO's loss is a mean over responses of their token means whatever actor.loss_agg_mode says (as verl's)."""


def sapo_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                     tau_pos: float = 1.0, tau_neg: float = 1.05, agg_mode: str = SAPO_AGG,
                     rollout_is_weights: Optional[Tensor] = None,
                     loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): no hard clip; each token's ratio r passes through a soft gate,
    -A * sigmoid(tau * (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg. The gate's slope is 1 at
    r = 1 (the policy gradient on policy) and fades smoothly as r leaves 1, faster for a larger tau.
    agg_mode is not read (verl's aggregates seq-mean-token-mean); nothing is clipped, so pg_clipfrac is 0."""
    m = _mask_like(response_mask, log_prob)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device))
    losses = -torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau) * advantages
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    stats = {"pg_clipfrac": zero, "ppo_kl": masked_mean(-log_ratio, m).detach(), "pg_clipfrac_lower": zero}
    return _aggregate(losses, m, rollout_is_weights, SAPO_AGG, loss_scale_factor), stats


def _dppo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, m: Tensor, kept_up: Tensor, kept_down: Tensor,
          clip_c: float, agg_mode: str, rollout_is_weights: Optional[Tensor],
          loss_scale_factor: Optional[float]) -> Tuple[Tensor, Dict[str, Tensor]]:
    """DPPO's surrogate, -sg(min(r, clip_c)) * A * log pi on the tokens whose move stays inside the divergence
    bound in the direction the advantage pushes (kept_up where A > 0, kept_down elsewhere), 0 on the others."""
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    kept = torch.where(advantages > 0, kept_up, kept_down).detach().to(m.dtype)
    losses = -advantages * torch.clamp(ratio, max=clip_c).detach() * log_prob * kept
    stats = {"pg_clipfrac": masked_mean(1.0 - kept, m), "ppo_kl": masked_mean(-log_ratio, m),
             "pg_clipfrac_lower": masked_mean((ratio > clip_c).to(m.dtype) * kept, m)}
    return (_aggregate(losses, m, rollout_is_weights, agg_mode, loss_scale_factor),
            {k: v.detach() for k, v in stats.items()})


def dppo_tv_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                        clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0, agg_mode: str = "token-mean",
                        rollout_is_weights: Optional[Tensor] = None,
                        loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879, verl's dppo_tv): the trust region is on the sampled token's probability,
    not its ratio: a token keeps its gradient while pi - pi_old <= clip_high (A > 0) or >= -clip_low (A <= 0);
    its importance weight is truncated at clip_c (verl reads actor.clip_ratio_c). pg_clipfrac: tokens dropped;
    pg_clipfrac_lower: kept tokens whose weight was truncated."""
    m = _mask_like(response_mask, log_prob)
    moved = torch.exp(log_prob) - torch.exp(old_log_prob)
    return _dppo(old_log_prob, log_prob, advantages, m, moved <= clip_high, moved >= -clip_low, clip_c, agg_mode,
                 rollout_is_weights, loss_scale_factor)


def dppo_kl_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                        clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0, agg_mode: str = "token-mean",
                        rollout_is_weights: Optional[Tensor] = None,
                        loss_scale_factor: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """DPPO-Binary-KL (verl's dppo_kl): as dppo_tv with the bound on the KL between the two Bernoulli
    distributions (sampled token or not) of pi_old and pi; a move against the advantage's push is never dropped."""
    m = _mask_like(response_mask, log_prob)
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return _dppo(old_log_prob, log_prob, advantages, m, (binary_kl <= clip_high) | (prob <= old_prob),
                 (binary_kl <= clip_low) | (prob >= old_prob), clip_c, agg_mode, rollout_is_weights, loss_scale_factor)
