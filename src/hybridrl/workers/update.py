"""The optimizer-step loop shared by actor and critic: mini-batches → micro-batches → one step each.

Each micro-batch loss is weighted by its share of the DP-global mini-batch normaliser (loss tokens
for token-mean, every row for the seq-mean modes, as verl's global batch size), so gradients and reported losses
are the mini-batch's `algos.agg_loss` whatever the micro-batch split and the DP size: fixed rows or
a token budget, each micro-batch trimmed to its real columns (`micro_batches.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List

import torch

from hybridrl.algos import agg_loss_denominator
from hybridrl.metrics import mean_of
from hybridrl.workers.engine import ModelEngine, dp_sum
from hybridrl.config.batching import MicroBatching
from hybridrl.parallel.expert_lockstep import width_agreement
from hybridrl.workers.micro_batches import plan_micro_batches, scatter_rows, split_rows


def global_weights(micro_batches: List[Dict[str, torch.Tensor]], mode: str, engine: ModelEngine) -> List[float]:
    """Share of each micro-batch in the DP-global mini-batch normaliser of `loss_agg_mode` `mode`.

    A micro-batch with no loss token gets 0; the seq-mean shares of a mini-batch with rows masked out entirely
    (rejection sampling) sum to less than 1, as verl's normaliser counts those rows. The constant of
    seq-mean-token-sum-norm is not part of the share: agg_loss divides by it (the same on every micro-batch)."""
    sizes = [agg_loss_denominator(mb["response_mask"], mode) for mb in micro_batches]
    if mode == "token-sum":  # no normaliser: each micro-batch's sum counts whole (0 or 1 here)
        return sizes
    # verl's global_batch_size: the seq-mean modes divide by every row of the mini-batch, rows that rejection
    # sampling masked out included (a micro-batch's own agg_loss divides by its rows with a loss token)
    whole = sum(sizes) if mode == "token-mean" else sum(mb["response_mask"].shape[0] for mb in micro_batches)
    total = dp_sum({"n": whole}, engine.groups)["n"]
    return [s / total if total > 0 else 0.0 for s in sizes]


@dataclass(frozen=True)
class Share:
    """A micro-batch's part of its DP-global mini-batch: of the loss normaliser (by loss_agg_mode),
    of the response tokens (token-level statistics such as clip fractions average by this) and of the policy
    term's normaliser (the loss's unless the policy loss aggregates its own way: GMPO)."""
    loss: float
    tokens: float
    policy: float


def ppo_update(engine: ModelEngine, optimizer, minis: Iterable[Dict[str, torch.Tensor]], batching: MicroBatching,
               agg_mode: str, loss_fn: Callable, role: str, apply: bool = True, token_fn: Callable | None = None,
               policy_agg: str | None = None):
    """One optimizer step per mini-batch; `loss_fn(output, mb, share, n_micro) -> (loss, stats)`, output the
    model's or, with `token_fn`, its per-token results (`ModelEngine.run`).
    apply=False runs the same forwards without backward or step (the dry run).

    Returns (mean metrics over the steps, per step the per-row tensors loss_fn returned under
    stats["rows"], in the mini-batch's row order at its full response width; empty dicts if none)."""
    history, rows_per_step = [], []
    for mini in minis:
        plan = plan_micro_batches(mini, batching)
        micro = split_rows(mini, plan, width_agreement(engine.groups))
        loss_shares = global_weights(micro, agg_mode, engine)
        token_shares = loss_shares if agg_mode == "token-mean" else global_weights(micro, "token-mean", engine)
        policy_shares = loss_shares if policy_agg in (None, agg_mode) else global_weights(micro, policy_agg, engine)
        shares = iter([Share(*w) for w in zip(loss_shares, token_shares, policy_shares)])
        engine.zero_grad()
        optimizer.zero_grad()
        stats = engine.run(micro, lambda out, mb: loss_fn(out, mb, next(shares), len(micro)), not apply, token_fn)
        rows = [s.pop("rows") for s in stats if "rows" in s]
        width = mini["response_mask"].shape[1]
        rows_per_step.append({k: scatter_rows([r[k] for r in rows], plan, width) for k in rows[0]} if rows else {})
        history.append(finish_step(engine, optimizer, stats, role, apply, advance=False))
    metrics = mean_of(history)
    if apply:  # the LR schedule moves once per training step, whatever the number of optimizer steps
        _advance(optimizer, metrics, role)
    return metrics, rows_per_step


def _advance(optimizer, metrics: dict, role: str) -> None:
    """The LR schedule moves on one training step; `<role>/lr` is then the LR after the move (the next update's),
    which is what verl 0.9.1 logs."""
    optimizer.advance_schedule()
    metrics[f"{role}/lr"] = optimizer.current_lr()


def check_one_step(what: str, fix: str, ppo_epochs: int, rows: int, mini_batch_rows: int) -> None:
    """`what` can come from an update's own forward only if it is the batch's one optimizer step."""
    if ppo_epochs != 1 or mini_batch_rows < rows:
        raise ValueError(f"{what} can come from the update's forward only for one optimizer step "
                         f"(ppo_epochs={ppo_epochs}, {rows} rows in mini-batches of {mini_batch_rows}); {fix} first")


def finish_step(engine: ModelEngine, optimizer, stats: List[dict], role: str, apply: bool = True,
                advance: bool = True):
    """Sum micro-batch metrics over DP, then take the optimizer step (a non-finite loss or grad norm stops the run;
    fp16 with a loss scaler skips the overflowing step instead);
    `advance`: this step is a whole training step, so the LR schedule moves on (and `<role>/lr` is the LR after
    that move, the next update's, which is what verl 0.9.1 logs). Metrics may be device
    tensors: they are summed where they are and read once (`dp_sum`), not once per micro-batch."""
    summed = {}
    for s in stats:
        for k, v in s.items():
            summed[k] = summed[k] + v if k in summed else v
    metrics = dp_sum({**summed, "micro_batches": float(len(stats))}, engine.groups)
    if metrics.pop("finite") < metrics.pop("micro_batches"):
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
    if advance:
        _advance(optimizer, metrics, role)
    return metrics
