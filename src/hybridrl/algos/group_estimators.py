"""Advantages measured within each prompt's group of responses: the group statistics GRPO, RLOO and
REINFORCE++-baseline share, verl 0.9.1's pass@k GRPO, OPO and GPG estimators, and its optimal token baseline.

The outcome estimators take per-response scores [B], the response mask [B, T] and a group id per response; the
optimal token baseline takes token rewards and the old policy's per-token statistics. Each returns (advantages,
returns) [B, T], the advantage on every loss token. Pure tensor math, as the rest of `hybridrl.algos`.
"""
from typing import Dict, Hashable, Sequence, Tuple, Union

import torch

from hybridrl.algos.masked import _mask_like

Tensor = torch.Tensor
GroupIndex = Union[Sequence[Hashable], Tensor]


def _group_ids(group_index: GroupIndex, batch: int, device) -> Tuple[Tensor, Tensor, Tensor]:
    """Map per-row ids to (one-hot [G, B] bool, group sizes [G], group of each row [B])."""
    if isinstance(group_index, Tensor):
        _, inverse = torch.unique(group_index.reshape(-1), return_inverse=True)
        inverse = inverse.to(device)
    else:
        seen: Dict[Hashable, int] = {}
        inverse = torch.tensor([seen.setdefault(g, len(seen)) for g in group_index],
                               dtype=torch.long, device=device)
    if inverse.numel() != batch:
        raise ValueError(f"group_index has {inverse.numel()} entries, expected {batch}")
    groups = int(inverse.max().item()) + 1 if batch else 0
    # One-hot reductions (rather than index_add atomics) keep GPU results deterministic.
    onehot = torch.arange(groups, device=device)[:, None] == inverse[None, :]
    return onehot, onehot.sum(dim=1), inverse


def _group_mean_std(scores: Tensor, group_index: GroupIndex) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-row group mean, unbiased std and group size; singletons get mean 0, std 1."""
    onehot, sizes, row_group = _group_ids(group_index, scores.shape[0], scores.device)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    n = sizes.to(scores.dtype)
    mean_g = torch.where(onehot, scores[None, :], zero).sum(dim=1) / n
    dev = scores - mean_g[row_group]
    var_g = torch.where(onehot, dev[None, :] ** 2, zero).sum(dim=1) / (n - 1).clamp(min=1)
    single = sizes == 1
    mean_g = torch.where(single, zero, mean_g)
    std_g = torch.where(single, torch.ones_like(var_g), var_g.sqrt())
    return mean_g[row_group], std_g[row_group], n[row_group]


def _members(group_index: GroupIndex, batch: int, device) -> list:
    """The row indices of each group, groups in order of first appearance."""
    onehot, _, _ = _group_ids(group_index, batch, device)
    return [torch.nonzero(row).reshape(-1) for row in onehot]


def compute_grpo_passk_advantages(scores: Tensor, response_mask: Tensor, group_index: GroupIndex,
                                  eps: float = 1e-6, norm_by_std: bool = True) -> Tuple[Tensor, Tensor]:
    """Pass@k training (Chen et al. 2025, verl's grpo_passk): only each group's best response gets an advantage,
    its margin over the second best (/ the group's unbiased std + eps when norm_by_std); the others get 0. The
    best is torch.topk's first pick, as verl's. A group needs at least two responses."""
    adv = torch.zeros_like(scores)
    for rows in _members(group_index, scores.shape[0], scores.device):
        group = scores[rows]
        if group.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt (rollout.n >= 2); a group has "
                             f"{group.numel()}")
        top, where = torch.topk(group, 2)
        margin = top[0] - top[1]
        adv[rows[where[0]]] = margin / (torch.std(group) + eps) if norm_by_std else margin
    adv = adv[:, None] * _mask_like(response_mask, scores)
    return adv, adv


def compute_opo_advantages(scores: Tensor, response_mask: Tensor, group_index: GroupIndex) -> Tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025, verl's opo): the score minus its group's length-weighted mean score (the optimal
    baseline under the paper's assumptions), lengths counted in loss tokens; a single response has baseline 0."""
    lengths = _mask_like(response_mask, scores).sum(dim=-1)
    baseline = torch.zeros_like(scores)
    for rows in _members(group_index, scores.shape[0], scores.device):
        if rows.numel() > 1:
            baseline[rows] = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
    adv = (scores - baseline)[:, None] * _mask_like(response_mask, scores)
    return adv, adv


def compute_gpg_advantages(scores: Tensor, response_mask: Tensor, group_index: GroupIndex,
                           f_norm: float = 1.0) -> Tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, verl's gpg): (score - group mean) / f_norm, times alpha = responses / responses
    with a nonzero score over the whole batch (the correction for groups that carry no signal); a single
    response has mean 0."""
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    mean, _, _ = _group_mean_std(scores, group_index)
    adv = (alpha * (scores - mean) / f_norm)[:, None] * _mask_like(response_mask, scores)
    return adv, adv


def _path_variance(token_rewards: Tensor, m: Tensor, old_log_probs: Tensor, sum_pi_squared: Tensor,
                   rollout_is_weights: Tensor | None) -> Tuple[Tensor, Tensor]:
    """(reward-to-go G, cumulative path-variance proxy W) [B, T] over the loss tokens m."""
    returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.square()
    return returns, (w * m).cumsum(-1)


def _minus_token_baselines(returns: Tensor, w_cum: Tensor, m: Tensor, group_index: GroupIndex, handle_zero_tail: bool,
                           eps: float) -> Tensor:
    """(G - B) * m with B_t = sum_i G_it W_it / sum_i W_it over each group of two or more responses (0 for a single
    one); with `handle_zero_tail` the one longest response of a group gets B = 0 past the second longest."""
    baselines = torch.zeros_like(returns)
    for rows in _members(group_index, returns.shape[0], returns.device):
        if rows.numel() < 2:
            continue
        g_mask, g_w = m[rows], w_cum[rows]
        baselines[rows] = ((returns[rows] * g_w * g_mask).sum(0) / ((g_w * g_mask).sum(0) + eps)).expand(len(rows), -1)
        if handle_zero_tail:
            lengths = g_mask.sum(-1)
            second, longest = (int(x) for x in torch.sort(lengths).values[-2:])
            alone = (lengths == longest).nonzero().reshape(-1)
            if alone.numel() == 1 and longest > second:
                baselines[rows[alone[0]], second:] = 0.0
    return (returns - baselines) * m


def compute_optimal_token_baseline_advantages(token_rewards: Tensor, response_mask: Tensor, group_index: GroupIndex,
                                              old_log_probs: Tensor, sum_pi_squared: Tensor,
                                              rollout_is_weights: Tensor | None = None, handle_zero_tail: bool = True,
                                              eps: float = 1e-8) -> Tuple[Tensor, Tensor]:
    """Optimal token baseline (verl 0.9.1's optimal_token_baseline): a baseline per group and time step,
    B_t = sum_i G_it W_it / sum_i W_it over the group's responses, G the reward-to-go and W_t = sum_{j <= t}
    (1 - 2 pi_j + sum_v pi_v^2) the cumulative path-variance proxy of the old policy (pi_j its probability of the
    sampled token, each term times the squared rollout IS weight where given). A single response has baseline 0;
    with `handle_zero_tail` the one longest response of a group gets 0 where it runs past the second longest.
    Returns (G - B on the loss tokens, G)."""
    m = _mask_like(response_mask, token_rewards)
    returns, w_cum = _path_variance(token_rewards, m, old_log_probs, sum_pi_squared, rollout_is_weights)
    return _minus_token_baselines(returns, w_cum, m, group_index, handle_zero_tail, eps), returns


def compute_tir_optimal_token_baseline_advantages(token_rewards: Tensor, response_mask: Tensor, group_index: GroupIndex,
                                                  old_log_probs: Tensor, sum_pi_squared: Tensor,
                                                  rollout_is_weights: Tensor | None = None,
                                                  handle_zero_tail: bool = True,
                                                  eps: float = 1e-8) -> Tuple[Tensor, Tensor]:
    """The multi-turn optimal token baseline (verl 0.9.1's tir_optimal_token_baseline): the time step is the
    response's own loss-token count, so a tool's output inside a trajectory (a hole in the mask) does not advance
    it and the k-th model token of every response of a group shares one baseline; a response without a loss token
    leaves its group. Returns (G - B on the loss tokens, G)."""
    m = _mask_like(response_mask, token_rewards)
    returns, w_cum = _path_variance(token_rewards, m, old_log_probs, sum_pi_squared, rollout_is_weights)
    lengths = m.sum(-1).long()
    order = torch.argsort((m == 0).to(torch.int8), dim=-1, stable=True)  # each row's loss tokens first, in order
    order = order[:, :int(lengths.max()) if lengths.numel() else 0]
    packed = (torch.arange(order.shape[1], device=m.device)[None] < lengths[:, None]).to(m.dtype)
    ids = group_index.tolist() if isinstance(group_index, Tensor) else list(group_index)
    ids = [g if n else ("no loss token", i) for i, (g, n) in enumerate(zip(ids, lengths.tolist()))]
    adv = _minus_token_baselines(returns.gather(1, order) * packed, w_cum.gather(1, order) * packed, packed, ids,
                                 handle_zero_tail, eps)
    return torch.zeros_like(returns).scatter_(1, order, adv) * m, returns
