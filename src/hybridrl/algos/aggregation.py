"""How per-token losses [B, T] become one number (verl 0.9.1's `loss_agg_mode`), and what a micro-batch's share
of its mini-batch's normaliser is, so that an update does not depend on how the mini-batch was split."""
from typing import Optional

import torch

from hybridrl.algos.masked import _mask_like, masked_mean, masked_sum

Tensor = torch.Tensor

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, loss_scale_factor: Optional[float] = None) -> Tensor:
    """Reduce a [B, T] token loss to a scalar, as verl 0.9.1's `core_algos.agg_loss` on one batch.

    token-mean: sum over the loss tokens / their count. token-sum: their sum (a mini-batch's loss is the sum
    over all of its tokens, on every DP rank together, as verl's). seq-mean-token-sum / -token-mean: the mean,
    over the rows that have at least one loss token (fully masked rows are left out, as verl does),
    of each row's token sum / token mean. seq-mean-token-sum-norm (Dr. GRPO): seq-mean-token-sum
    divided by a constant, `loss_scale_factor`, else the width T of `mask` (verl's default; callers
    that trim micro-batches pass the configured response length). Where verl divides 0 by 0 (no loss
    token at all) this returns 0, never NaN.
    """
    m = _mask_like(mask, loss_mat)
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    if mode == "token-sum":
        return masked_sum(loss_mat, m)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    tokens = m.sum(dim=-1)
    row_loss = masked_sum(loss_mat, m, dim=-1)
    if mode == "seq-mean-token-mean":
        row_loss = row_loss / (tokens + 1e-8)  # verl's epsilon (a no-op in fp32 for a row with tokens)
    rows = (tokens > 0).to(loss_mat.dtype)
    loss = (row_loss * rows).sum() / rows.sum().clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def agg_loss_denominator(mask: Tensor, mode: str) -> float:
    """What agg_loss divides by before any constant: loss tokens (token-mean) or rows with a loss
    token (seq-mean-*). A micro-batch's share of the mini-batch normaliser is its denominator over
    the sum of all of them, which makes sum(share * agg_loss(micro-batch)) = agg_loss(mini-batch). token-sum has
    none (1 where the micro-batch holds a loss token): every micro-batch's sum counts whole."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    tokens = (mask != 0).sum(dim=-1)
    if mode == "token-sum":
        return float(tokens.sum() > 0)
    return float(tokens.sum()) if mode == "token-mean" else float((tokens > 0).sum())
