"""The critic (value model): values of response positions and the clipped value-loss update."""
from __future__ import annotations

from typing import Dict

import torch

from hybridrl import algos
from hybridrl.config import CriticConfig
from hybridrl.workers.engine import ModelEngine, mini_batches
from hybridrl.config.batching import MicroBatching
from hybridrl.workers.micro_batches import run_per_row
from hybridrl.workers.update import Share, check_one_step, ppo_update


def response_values(values: torch.Tensor, response_len: int) -> torch.Tensor:
    """V(s_t) for the state before each response token: [B, R] (verl's slice)."""
    T = values.shape[1]
    return values[:, T - response_len - 1:T - 1].float()


def value_tokens(values: torch.Tensor, labels: torch.Tensor) -> dict:
    """The critic's per-token results (`ModelEngine.run`'s token_fn): its values, in any sequence layout."""
    return {"values": values.float()}


def values_source(cfg, layout) -> str:
    """Where a PPO step's values come from: "update" (GAE, and one critic step per rollout batch:
    ppo_epochs 1 and one mini-batch, so the critic is unchanged until its update's forward, which
    gives the values exactly and GAE per row from them), else "pass" (a forward of their own)."""
    if (cfg.algorithm.adv_estimator == "gae" and cfg.critic.ppo_epochs == 1
            and layout.critic_mini_batch_samples == layout.samples_per_step):
        return "update"
    return "pass"


class CriticWorker:
    def __init__(self, engine: ModelEngine, optimizer, cfg: CriticConfig, max_response_length: int,
                 gamma: float = 1.0, lam: float = 1.0):
        self.engine, self.optimizer, self.cfg = engine, optimizer, cfg
        self.gamma, self.lam = gamma, lam
        """GAE's discount and lambda, for the values the update's own forward gives."""
        # seq-mean-token-sum-norm divides by a constant, never by a (trimmed) micro-batch's width
        self.loss_scale_factor = cfg.loss_scale_factor or max_response_length

    @torch.no_grad()
    def compute_values(self, batch: Dict[str, torch.Tensor], batching: MicroBatching) -> torch.Tensor:
        self.engine.train(False)

        def loss_fn(tokens, mb):
            v = response_values(tokens["values"], mb["response_mask"].shape[1]) * mb["response_mask"]
            return v.new_zeros(()), {"values": v.detach()}

        keys = ("input_ids", "attention_mask", "response_mask")
        return run_per_row(self.engine, {k: batch[k] for k in keys}, batching, loss_fn, value_tokens)["values"]

    def _loss(self, tokens, mb, share: Share, n_micro: int):
        mask = mb["response_mask"]
        values = response_values(tokens["values"], mask.shape[1])
        rows = None
        if "values" in mb:
            old, returns = mb["values"], mb["returns"]
        else:  # the critic before this step is the current one: its values are this forward's, held constant
            old = values.detach() * mask
            advantages, returns = algos.gae_returns(mb["token_rewards"], old, mask, self.gamma, self.lam)
            rows = {"values": old, "returns": returns, "gae_advantages": advantages}
        vf_loss, clipfrac = algos.value_loss(values, old, returns, mask, self.cfg.cliprange_value,
                                             self.cfg.loss_agg_mode, self.loss_scale_factor)
        # summed over micro-batches and DP later: the loss by its normaliser, token means by tokens
        # device tensors, read once per step (update.finish_step)
        metrics = {"critic/vf_loss": vf_loss.detach().double() * share.loss,
                   "critic/vf_clipfrac": clipfrac.detach().double() * share.tokens,
                   "critic/vpred_mean": algos.masked_mean(values.detach(), mask).double() * share.tokens}
        scaled = vf_loss * share.loss * n_micro * self.engine.groups.dp
        out = {**metrics, "finite": torch.isfinite(vf_loss.detach()).double()}
        if rows is not None:
            out["rows"] = rows
        return scaled, out

    def update_critic(self, batch: Dict[str, torch.Tensor], mini_batch_rows: int, batching: MicroBatching,
                      apply: bool = True):
        """ppo_epochs passes of the clipped value loss over mini-batches; mean metrics over steps.

        Without batch["values"] (`values_source` "update") this must be one optimizer step: its
        forward gives the values, and from batch["token_rewards"] each row's GAE; they are stored in
        batch["values"], batch["returns"] and batch["gae_advantages"] (raw, not yet whitened)."""
        self.engine.train(True)
        own = "values" not in batch
        if own:
            check_one_step("values", "compute them with compute_values", self.cfg.ppo_epochs,
                           batch["response_mask"].shape[0], mini_batch_rows)
        keys = ("input_ids", "attention_mask", "response_mask") + (("token_rewards",) if own else ("values", "returns"))
        minis = mini_batches(batch, keys, mini_batch_rows, self.cfg.ppo_epochs)
        metrics, per_step = ppo_update(self.engine, self.optimizer, minis, batching, self.cfg.loss_agg_mode,
                                       self._loss, "critic", apply, value_tokens)
        if own:
            batch.update(per_step[0])
        return metrics
