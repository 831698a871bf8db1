"""The optimizer-step loop shared by actor and critic: mini-batches → micro-batches → one step each.

Each micro-batch loss is weighted by its share of the DP-global mini-batch normaliser (loss tokens
for token-mean, rows with a loss token for the seq-mean modes), so gradients and reported losses
are the mini-batch's `algos.agg_loss` whatever the micro-batch split and the DP size.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List

import torch

from hybridrl.algos import agg_loss_denominator
from hybridrl.metrics import mean_of
from hybridrl.workers.engine import ModelEngine, dp_sum, split_micro_batches


def global_weights(micro_batches: List[Dict[str, torch.Tensor]], mode: str, engine: ModelEngine) -> List[float]:
    """Share of each micro-batch in the DP-global mini-batch normaliser of `loss_agg_mode` `mode`.

    A micro-batch with no loss token gets 0. The constant of seq-mean-token-sum-norm is not part
    of the share: agg_loss divides by it (the same on every micro-batch)."""
    sizes = [agg_loss_denominator(mb["response_mask"], mode) for mb in micro_batches]
    total = dp_sum({"n": sum(sizes)}, engine.groups)["n"]
    return [s / total if total > 0 else 0.0 for s in sizes]


def ppo_update(engine: ModelEngine, optimizer, minis: Iterable[Dict[str, torch.Tensor]], micro_size: int,
               agg_mode: str, loss_fn: Callable, role: str, apply: bool = True) -> Dict[str, float]:
    """One optimizer step per mini-batch; `loss_fn(output, mb, weight, n_micro) -> (loss, stats)`.
    apply=False runs the same forwards without backward or step (the dry run)."""
    history = []
    for mini in minis:
        micro = split_micro_batches(mini, micro_size)
        weights = iter(global_weights(micro, agg_mode, engine))
        engine.zero_grad()
        optimizer.zero_grad()
        stats = engine.run(micro, lambda out, mb: loss_fn(out, mb, next(weights), len(micro)), not apply)
        history.append(finish_step(engine, optimizer, stats, role, apply))
    return mean_of(history)


def finish_step(engine: ModelEngine, optimizer, stats: List[dict], role: str, apply: bool = True):
    """Sum micro-batch metrics over DP, then take the optimizer step (skipped on a non-finite loss)."""
    summed = {}
    for s in stats:
        for k, v in s.items():
            summed[k] = summed.get(k, 0.0) + float(v)
    n_finite = summed.pop("finite")
    metrics = dp_sum(summed, engine.groups)
    finite = dp_sum({"f": n_finite, "n": float(len(stats))}, engine.groups)
    if finite["f"] < finite["n"]:
        bad = [k for k, v in metrics.items() if v != v or abs(v) == float("inf")]
        raise FloatingPointError(f"{role} loss is not finite ({', '.join(bad) or 'loss'})")
    if not apply:
        return metrics
    updated, grad_norm, lr = optimizer.step()
    scaled = getattr(optimizer, "skips_overflow_steps", False)  # fp16 with megatron's loss scaler
    if not updated and not scaled:
        raise FloatingPointError(f"{role} gradient norm is not finite ({grad_norm})")
    if scaled:  # an overflowing step is skipped while the scaler lowers its scale
        metrics.update({f"{role}/loss_scale": optimizer.loss_scale, f"{role}/skipped_steps": float(not updated)})
    if updated:
        metrics[f"{role}/grad_norm"] = grad_norm
    metrics[f"{role}/lr"] = lr
    return metrics
