"""The critic (value model): values of response positions and the clipped value-loss update."""
from __future__ import annotations

from typing import Dict

import torch

from hybridrl import algos
from hybridrl.config import CriticConfig
from hybridrl.workers.engine import ModelEngine, mini_batches
from hybridrl.workers.micro_batches import MicroBatching, run_per_row
from hybridrl.workers.update import Share, ppo_update


def response_values(values: torch.Tensor, response_len: int) -> torch.Tensor:
    """V(s_t) for the state before each response token: [B, R] (verl's slice)."""
    T = values.shape[1]
    return values[:, T - response_len - 1:T - 1].float()


class CriticWorker:
    def __init__(self, engine: ModelEngine, optimizer, cfg: CriticConfig, max_response_length: int):
        self.engine, self.optimizer, self.cfg = engine, optimizer, cfg
        # seq-mean-token-sum-norm divides by a constant, never by a (trimmed) micro-batch's width
        self.loss_scale_factor = cfg.loss_scale_factor or max_response_length

    @torch.no_grad()
    def compute_values(self, batch: Dict[str, torch.Tensor], batching: MicroBatching) -> torch.Tensor:
        self.engine.train(False)

        def loss_fn(output, mb):
            v = response_values(output, mb["response_mask"].shape[1]) * mb["response_mask"]
            return output.new_zeros(()), {"values": v.detach()}

        keys = ("input_ids", "attention_mask", "response_mask")
        return run_per_row(self.engine, {k: batch[k] for k in keys}, batching, loss_fn)["values"]

    def _loss(self, output, mb, share: Share, n_micro: int):
        mask = mb["response_mask"]
        values = response_values(output, mask.shape[1])
        vf_loss, clipfrac = algos.value_loss(values, mb["values"], mb["returns"], mask, self.cfg.cliprange_value,
                                             self.cfg.loss_agg_mode, self.loss_scale_factor)
        # summed over micro-batches and DP later: the loss by its normaliser, token means by tokens
        metrics = {"critic/vf_loss": vf_loss.item() * share.loss, "critic/vf_clipfrac": float(clipfrac) * share.tokens,
                   "critic/vpred_mean": algos.masked_mean(values, mask).item() * share.tokens}
        scaled = vf_loss * share.loss * n_micro * self.engine.groups.dp
        return scaled, {**metrics, "finite": torch.isfinite(vf_loss).item()}

    def update_critic(self, batch: Dict[str, torch.Tensor], mini_batch_rows: int, batching: MicroBatching,
                      apply: bool = True):
        self.engine.train(True)
        keys = ("input_ids", "attention_mask", "response_mask", "values", "returns")
        minis = mini_batches(batch, keys, mini_batch_rows, self.cfg.ppo_epochs)
        metrics, _ = ppo_update(self.engine, self.optimizer, minis, batching, self.cfg.loss_agg_mode, self._loss,
                                "critic", apply)
        return metrics
