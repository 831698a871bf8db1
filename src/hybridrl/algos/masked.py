"""Masked statistics over [B, T] tensors: sums, means, variance and whitening where a mask is nonzero.

Masks are float or bool; masked entries never leak NaN or inf from the data. Pure tensor math on one
process, as the rest of `hybridrl.algos`.
"""
import torch

Tensor = torch.Tensor

WHITEN_EPS = 1e-8


def _mask_like(mask: Tensor, like: Tensor) -> Tensor:
    # Bool and float masks both become weights in the data's dtype/device.
    return mask.to(dtype=like.dtype, device=like.device)


def masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Sum of x*mask; masked entries never leak NaN/inf from x."""
    m = _mask_like(mask, x)
    prod = torch.where(m != 0, x * m, torch.zeros_like(x))
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Mean of x over mask; an empty mask gives 0 (not NaN)."""
    m = _mask_like(mask, x)
    total = m.sum() if dim is None else m.sum(dim=dim)
    # Exact division where there is data; empty slices divide 0 by 1.
    return masked_sum(x, m, dim) / torch.where(total != 0, total, torch.ones_like(total))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over the whole mask (Bessel-corrected when unbiased)."""
    m = _mask_like(mask, x)
    n = m.sum()
    if n.item() == 0:
        raise ValueError("masked_var: the mask selects no element")
    var = masked_mean((x - masked_mean(x, m)) ** 2, m)
    # A single element has no spread; skip Bessel instead of producing 0/0.
    if unbiased and n.item() > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the mask; keeps the mean if not shift_mean."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask, unbiased=True) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean
