"""Rollout correction as verl 0.9.1 does it (`trainer/ppo/rollout_corr_helper.py`): the engine that sampled
(pi_rollout) and the trainer that learns (pi_old) disagree (bf16 engines, MoE routing, stale weights);
importance sampling (IS) reweights the loss by pi_old / pi_rollout, rejection sampling (RS) drops tokens or
sequences whose divergence is too large, and `rollout_corr/*` metrics measure the gap.

`compute_rollout_correction_and_rejection_mask` has verl's name, arguments and results (the weights as a
tensor instead of verl's DataProto), so tests compare it with verl itself. Semantics kept from verl, hard
cases included: log-ratios are clamped at +-20 before exp; a fully masked row counts in the per-sequence
batch means (its sequence log-ratio is 0); thresholds are verl's strings ("lower_upper" for IcePop and
for the k1 options, comma separated per RS option). Pure tensor math on one process: the caller gathers
the batch it corrects (the trainer does it over DP), so batch normalisation is over what it is given.
"""
import math
from typing import Dict, List, Optional, Tuple, Union

import torch

from hybridrl.algos.masked import masked_sum

Tensor = torch.Tensor
Threshold = Union[float, int, str]

SAFETY_BOUND = 20.0
"""|log-ratio| past which exp() is clamped (exp(20) ~ 4.9e8)."""
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """verl's masked mean: sum over the mask / (count + 1e-8), so an empty slice gives 0."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / (count + 1e-8)


def _masked_max(x: Tensor, mask: Tensor) -> float:
    return x.masked_fill(~mask.bool(), float("-inf")).max().item()


def _masked_min(x: Tensor, mask: Tensor) -> float:
    return x.masked_fill(~mask.bool(), float("inf")).min().item()


def _std(values: Tensor) -> float:
    """Unbiased std of a 1-D tensor; 0 for a single value (verl's convention)."""
    return values.std().item() if values.numel() > 1 else 0.0


def _clamped_std(stat: Tensor, mask: Tensor, low: float, high: float) -> float:
    """sqrt(E[s^2] - E[s]^2) over the mask of s clamped to [low, high]; 0 with fewer than two tokens."""
    if mask.sum() <= 1:
        return 0.0
    s = stat.clamp(min=low, max=high)
    return torch.sqrt(torch.clamp(_mean(s.square(), mask) - _mean(s, mask).square(), min=0.0)).item()


# ----------------------------------------------------------------------------- thresholds


def _positive_pair(spec: str, what: str) -> Tuple[float, float]:
    """"lower_upper" -> (lower, upper), both > 0 and lower <= upper."""
    try:
        lower, upper = (float(x) for x in spec.split("_", 1))
    except ValueError as err:
        raise ValueError(f"{what}: '{spec}' is not a number or 'lower_upper'") from err
    if lower <= 0 or upper <= 0 or lower > upper:
        raise ValueError(f"{what}: '{spec}' needs 0 < lower <= upper")
    return lower, upper


def _positive(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError as err:
        raise ValueError(f"{what}: '{text}' is not a number or 'lower_upper'") from err
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got '{text}'")
    return value


def parse_is_threshold(spec: Threshold) -> Tuple[float, Optional[float]]:
    """(upper, lower or None): a number truncates at it (TIS); "lower_upper" zeroes outside (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, not {spec!r}")
    text = str(spec).strip()
    if isinstance(spec, str) and "_" in text:
        lower, upper = _positive_pair(text, "rollout_is_threshold")
        return upper, lower
    return _positive(text, "rollout_is_threshold"), None


def parse_rs_options(rollout_rs: str) -> List[str]:
    """The comma-separated RS options, duplicates dropped, each one of RS_OPTIONS."""
    if not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a comma-separated string of options, e.g. 'seq_mean_k3'")
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    bad = [o for o in options if o not in RS_OPTIONS]
    if not options or bad:
        raise ValueError(f"rollout_rs options {bad or rollout_rs!r} unknown; valid: {', '.join(RS_OPTIONS)}")
    return options


def parse_rs_thresholds(options: List[str], spec: Optional[Threshold]) -> Dict[str, Tuple[Optional[float], float]]:
    """{option: (lower, upper)}: one entry per option, or one shared by all. k1 options bound the ratio
    ("lower_upper", or an upper whose reciprocal is the lower); k2 / k3 take an upper bound only."""
    if spec is None or isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold must be given as a number or string for rollout_rs, got {spec!r}")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold has {len(parts)} entries for {len(options)} rollout_rs options; "
                         "give one shared threshold or one per option")
    parts = parts * len(options) if len(parts) == 1 else parts
    out = {}
    for option, part in zip(options, parts):
        what = f"rollout_rs_threshold for {option}"
        if "_" in part:
            if not option.endswith("k1"):
                raise ValueError(f"{what} is an upper bound only (k2 / k3), got '{part}'")
            out[option] = _positive_pair(part, what)
            continue
        upper = _positive(part, what)
        out[option] = _positive_pair(f"{1.0 / upper}_{upper}", what) if option.endswith("k1") else (None, upper)
    return out


# ----------------------------------------------------------------------------- rejection sampling


def _seq_max(x: Tensor, mask: Tensor) -> Tensor:
    """Per-row max over the mask; 0 for a row without tokens."""
    best = x.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isneginf(best), torch.zeros_like(best), best)


def _rs_statistic(option: str, divergence: Dict[str, Tensor], mask: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """(per-token statistic [B, T], per-sequence statistic [B] or None for the token options)."""
    level, kind = option.rsplit("_", 1)
    token = divergence[kind]
    if level == "token":
        return token, None
    seq = {"seq_sum": lambda: masked_sum(token, mask, -1), "seq_mean": lambda: _mean(token, mask, -1),
           "seq_max": lambda: _seq_max(token, mask)}[level]()
    return seq[:, None].expand_as(mask), seq


def _rs_metrics(prefix: str, stat: Tensor, seq_stat: Optional[Tensor], mask: Tensor, seq_valid: Tensor,
                lower: float, upper: float, two_sided: bool) -> Dict[str, float]:
    """verl's per-option RS statistics: the statistic's mean, range, fractions past the bounds and std over
    tokens (over sequences, for the sequence options), and its sequence-level summary. `lower` is 0 for the
    one-sided (k2, k3) options: only the std's clamp uses it there."""
    per_seq = (seq_stat if seq_stat is not None else _mean(stat, mask, -1))[seq_valid]
    by_seq = seq_stat is not None and per_seq.numel() > 0
    low_side = lambda x: x < lower if two_sided else torch.zeros_like(x, dtype=torch.bool)
    out = {f"{prefix}_mean": _mean(stat, mask).item()}
    if by_seq:
        out.update({f"{prefix}_max": per_seq.max().item(), f"{prefix}_min": per_seq.min().item(),
                    f"{prefix}_fraction_high": (per_seq > upper).float().mean().item(),
                    f"{prefix}_fraction_low": low_side(per_seq).float().mean().item()})
    else:
        out.update({f"{prefix}_max": _masked_max(stat, mask), f"{prefix}_min": _masked_min(stat, mask),
                    f"{prefix}_fraction_high": _mean((stat > upper).float(), mask).item(),
                    f"{prefix}_fraction_low": _mean(low_side(stat).float(), mask).item()})
    out[f"{prefix}_std"] = _clamped_std(stat, mask, lower, upper)
    out.update({f"{prefix}_seq_mean": per_seq.mean().item(), f"{prefix}_seq_std": _std(per_seq),
                f"{prefix}_seq_max": per_seq.max().item(), f"{prefix}_seq_min": per_seq.min().item(),
                f"{prefix}_seq_max_deviation": per_seq.abs().max().item(),
                f"{prefix}_seq_fraction_high": (per_seq > upper).float().mean().item()})
    if two_sided:
        out[f"{prefix}_seq_fraction_low"] = (per_seq < lower).float().mean().item()
    return out


def compute_rollout_rejection_mask(log_ratio: Tensor, response_mask: Tensor, rollout_rs: str,
                                   rollout_rs_threshold: Threshold) -> Tuple[Tensor, Dict[str, float]]:
    """(response_mask with rejected tokens / sequences zeroed, metrics): every option of `rollout_rs` must pass.

    With r = pi_old / pi_rollout: k1 = -log r, kept within [log lower, log upper]; k2 = (log r)^2 / 2 and
    k3 = r - 1 - log r, kept up to the bound. token_* judge each token, seq_sum_* / seq_mean_* / seq_max_* the
    row's sum / mean / max of the token values (a rejected row loses every token)."""
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, rollout_rs_threshold)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    mask = response_mask.to(log_ratio.dtype)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergence = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    valid, seq_valid = mask.bool(), mask.sum(dim=-1) > 0
    keep_all = torch.ones_like(mask)
    metrics: Dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        two_sided = option.endswith("k1")
        if two_sided:
            lower, upper = math.log(lower), math.log(upper)
        stat, seq_stat = _rs_statistic(option, divergence, mask)
        keep = (stat <= upper) & (stat >= lower) if two_sided else stat <= upper
        keep_all = keep_all * keep.to(mask.dtype)
        prefix = f"rollout_rs_{option}"
        metrics.update(_rs_metrics(prefix, stat, seq_stat, mask, seq_valid, lower if two_sided else 0.0, upper,
                                   two_sided))
        rejected_rows = (~keep & valid).any(dim=-1) & seq_valid
        metrics[f"{prefix}_masked_fraction"] = _mean(1.0 - keep.to(mask.dtype), mask).item()
        metrics[f"{prefix}_seq_masked_fraction"] = (
            rejected_rows.float().sum() / seq_valid.float().sum()).item() if seq_valid.any() else 0.0
    metrics["rollout_rs_masked_fraction"] = _mean(1.0 - keep_all, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = ((keep_all <= 0.5) & valid).any(dim=-1).float().mean().item()
    return (response_mask * keep_all).to(response_mask.dtype), metrics


# ----------------------------------------------------------------------------- importance sampling


def _is_metrics(weights: Tensor, raw: Tensor, log_ratio: Tensor, mask: Tensor, level: str, upper: float,
                lower: Optional[float]) -> Dict[str, float]:
    """verl's IS statistics: mean / max / min, fractions past the bounds (of the raw ratios), std and effective
    sample size of the applied weights, and the per-sequence summary. log_ratio is [B, 1] per sequence."""
    lower = 1.0 / upper if lower is None else lower
    out = {"rollout_is_mean": _mean(weights, mask).item()}
    if level == "sequence":  # over every row, fully masked ones (ratio 1) included, as verl
        log_upper, log_lower = torch.log(torch.tensor(upper)), torch.log(torch.tensor(lower))
        out.update({"rollout_is_max": torch.exp(log_ratio.max().clamp(max=SAFETY_BOUND)).item(),
                    "rollout_is_min": torch.exp(log_ratio.min()).item(),
                    "rollout_is_ratio_fraction_high": (log_ratio > log_upper).float().mean().item(),
                    "rollout_is_ratio_fraction_low": (log_ratio < log_lower).float().mean().item()})
    else:
        out.update({"rollout_is_ratio_fraction_high": _mean((raw > upper).float(), mask).item(),
                    "rollout_is_ratio_fraction_low": _mean((raw < lower).float(), mask).item(),
                    "rollout_is_max": _masked_max(weights, mask), "rollout_is_min": _masked_min(weights, mask)})
    out["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    bounded = weights.clamp(min=0.0, max=upper)
    normalized = bounded / (_mean(bounded, mask) + 1e-8)
    second_moment = _mean(normalized.square(), mask).item()
    out["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment else float("inf")
    per_seq, raw_per_seq = _mean(weights, mask, -1), _mean(raw, mask, -1)
    out.update({"rollout_is_seq_mean": per_seq.mean().item(), "rollout_is_seq_std": _std(per_seq),
                "rollout_is_seq_max": per_seq.max().item(), "rollout_is_seq_min": per_seq.min().item(),
                "rollout_is_seq_max_deviation": (per_seq - 1.0).abs().max().item(),
                "rollout_is_seq_fraction_high": (raw_per_seq > upper).float().mean().item(),
                "rollout_is_seq_fraction_low": (raw_per_seq < lower).float().mean().item()})
    return out


def compute_rollout_correction_weights(log_ratio: Tensor, response_mask: Tensor, rollout_is: str = "token",
                                       rollout_is_threshold: Threshold = 2.0, rollout_is_batch_normalize: bool = False
                                       ) -> Tuple[Tensor, Dict[str, float]]:
    """(IS weights [B, T], zero on masked tokens and detached; metrics).

    token: exp(log r) per token; sequence: exp(sum of the row's log r) on each of its tokens. A number
    threshold truncates the weights at it (TIS); "lower_upper" zeroes weights outside [lower, upper] (IcePop).
    rollout_is_batch_normalize divides by the mean weight (over tokens; over rows for sequence)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(IS_LEVELS)} (or None), got {rollout_is!r}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    mask = response_mask.to(log_ratio.dtype)
    if rollout_is == "token":
        per_level = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        per_level = masked_sum(log_ratio, mask, -1)[:, None]
        raw = torch.exp(per_level.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, per_level, mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _mean(((raw < lower) | (raw > upper)).float(), mask).item()
    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = _mean(weights, mask)
        else:
            rows = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (_mean(weights, mask, -1) * rows).sum() / rows.sum().clamp_min(1e-8)
        metrics["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
        weights = weights / mean if mean > 1e-8 else weights
    return weights, metrics


# ----------------------------------------------------------------------------- the gap itself


def compute_offpolicy_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
                              ) -> Dict[str, float]:
    """KL(pi_rollout || pi_old) (k1 and k3), perplexities and their ratio per sequence, chi^2 of the ratios."""
    mask = response_mask.to(old_log_prob.dtype)
    old_mean, rollout_mean = _mean(old_log_prob, mask, -1), _mean(rollout_log_prob, mask, -1)
    log_ratio = old_log_prob - rollout_log_prob
    log_ppl_diff = rollout_mean - old_mean  # log(training ppl / rollout ppl) per sequence
    seq_log_ratio = masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return {"training_ppl": torch.exp(-old_mean).mean().item(), "training_log_ppl": (-old_mean).mean().item(),
            "kl": _mean(-log_ratio, mask).item(),
            "k3_kl": _mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
            "rollout_ppl": torch.exp(-rollout_mean).mean().item(), "rollout_log_ppl": (-rollout_mean).mean().item(),
            "log_ppl_diff": log_ppl_diff.mean().item(), "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
            "log_ppl_diff_max": log_ppl_diff.max().item(), "log_ppl_diff_min": log_ppl_diff.min().item(),
            "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
            "chi2_token": (_mean(rho.square(), mask) - 1.0).item(),
            "chi2_seq": (torch.exp(2.0 * seq_log_ratio).mean() - 1.0).item()}


def compute_rollout_correction_and_rejection_mask(
        old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, rollout_is: Optional[str] = None,
        rollout_is_threshold: Optional[Threshold] = 2.0, rollout_is_batch_normalize: bool = False,
        rollout_rs: Optional[str] = None, rollout_rs_threshold: Optional[Threshold] = None
) -> Tuple[Optional[Tensor], Tensor, Dict[str, float]]:
    """verl 0.9.1's entry point: (IS weights [B, T] or None when rollout_is is None, response_mask with the
    rejections applied, metrics under rollout_corr/). old_log_prob is the trainer's (pi_old), rollout_log_prob
    the engine's; the off-policy metrics are always there."""
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} differ")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: Dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(log_ratio, response_mask, rollout_is,
                                                                 rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold; set it (e.g. 0.01 for seq_mean_k3)")
        mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def rollout_probs_diff_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
                               ) -> Dict[str, float]:
    """verl's debug metrics of the engine against the trainer, on probabilities: |p_old - p_rollout| (max, mean,
    unbiased std) and their Pearson correlation over the response tokens."""
    valid = response_mask.bool()
    if not valid.any():
        nan = float("nan")
        return {"training/rollout_probs_diff_valid": 0, "training/rollout_probs_diff_max": nan,
                "training/rollout_probs_diff_mean": nan, "training/rollout_probs_diff_std": nan,
                "training/rollout_actor_probs_pearson_corr": nan}
    old, rollout = torch.exp(old_log_prob)[valid], torch.exp(rollout_log_prob)[valid]
    diff = (old - rollout).abs()
    one = diff.numel() < 2  # no spread: NaN, as torch (and so verl) gives, without its warning
    return {"training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": float("nan") if one else diff.std().item(),
            "training/rollout_actor_probs_pearson_corr":
                float("nan") if one else torch.corrcoef(torch.stack([old, rollout]))[0, 1].item()}
