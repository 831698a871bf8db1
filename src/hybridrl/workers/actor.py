"""The actor (policy) and the frozen reference: log-probs of responses and the PPO policy update.

Losses are normalised over the whole mini-batch across DP ranks (`update.global_weights`, by
`loss_agg_mode`), so the gradient and the reported losses do not depend on how the mini-batch is
split into micro-batches or DP shards. The policy loss is `actor.policy_loss.loss_mode`: vanilla
(dual-clip PPO) or gspo (sequence-level ratio).
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import torch

from hybridrl import algos
from hybridrl.algos import covariance_losses, token_losses
from hybridrl.config import ActorConfig, Config, RolloutCorrectionConfig
from hybridrl.models.logprobs import vocab_parallel_sum_pi_squared, vocab_parallel_token_stats
from hybridrl.workers.engine import ModelEngine, mini_batches
from hybridrl.config.batching import MicroBatching
from hybridrl.workers.micro_batches import run_per_row
from hybridrl.workers.moe_metrics import RouterStats, pass_metrics
from hybridrl.workers.update import Share, check_one_step, ppo_update


def response_positions(per_token: torch.Tensor, response_len: int) -> torch.Tensor:
    """The [B, R] entries of a [B, S] per-token tensor at the positions that predict the response tokens."""
    S = per_token.shape[1]
    return per_token[:, S - response_len - 1:S - 1]


class LogProbWorker:
    """Shared by actor and reference: response log-probs (and entropy) from a GPT model."""

    def __init__(self, engine: ModelEngine, vocab_size: int, temperature: float):
        self.engine, self.vocab_size, self.temperature = engine, vocab_size, temperature
        self.offloader = None
        """Set for a reference whose weights live on the host between uses (ref.offload_params)."""

    def token_fn(self, with_entropy: bool, entropy_grad: bool = False, with_sum_pi_squared: bool = False):
        """Per-token log-probs of the next token (and entropy, sum pi^2) from TP-sharded logits, in whatever
        sequence layout the model runs (padded, packed, context parallel: `ModelEngine.run`); the entropy keeps no
        autograd state unless entropy_grad (a loss term needs it)."""
        tp_group, t = self.engine.groups.tp_group, self.temperature if self.temperature > 0 else 1.0

        def stats(logits, labels):
            log_probs, entropy = vocab_parallel_token_stats(logits, labels, tp_group, self.vocab_size, t,
                                                            with_entropy)
            out = {"log_probs": log_probs}
            if entropy is not None:
                out["entropy"] = entropy if entropy_grad else entropy.detach()  # a metric only: no backward
            if with_sum_pi_squared:
                out["sum_pi_squared"] = vocab_parallel_sum_pi_squared(logits, tp_group, self.vocab_size, t)
            return out

        return stats

    @staticmethod
    def _token_stats(tokens, mb):
        """[b, r] log-probs of the response tokens and their entropy (None when not computed)."""
        R = mb["responses"].shape[1]
        entropy = tokens.get("entropy")
        return response_positions(tokens["log_probs"], R), None if entropy is None else response_positions(entropy, R)

    @torch.no_grad()
    def compute_log_prob(self, batch: Dict[str, torch.Tensor], batching: MicroBatching, with_entropy: bool = False):
        """[B, R] log-probs (and entropy) of batch["responses"]; no gradients."""
        out = self.compute_token_stats(batch, batching, with_entropy)
        return out["log_probs"], out.get("entropy")

    @torch.no_grad()
    def compute_token_stats(self, batch: Dict[str, torch.Tensor], batching: MicroBatching, with_entropy: bool = False,
                            with_sum_pi_squared: bool = False) -> Dict[str, torch.Tensor]:
        """{"log_probs", and "entropy" / "sum_pi_squared" where asked}: [B, R] per response token; no gradients."""
        self.engine.train(False)
        R = batch["responses"].shape[1]

        def loss_fn(tokens, mb):
            lp, ent = self._token_stats(tokens, mb)
            out = {"log_probs": lp.detach()}
            if ent is not None:
                out["entropy"] = ent.detach()
            if "sum_pi_squared" in tokens:
                out["sum_pi_squared"] = response_positions(tokens["sum_pi_squared"], R)
            return lp.new_zeros(()), out

        keys = ("input_ids", "attention_mask", "responses", "response_mask", "routed_experts")
        return run_per_row(self.engine, {k: batch[k] for k in keys if k in batch}, batching, loss_fn,
                           self.token_fn(with_entropy, with_sum_pi_squared=with_sum_pi_squared))


def old_log_prob_source(cfg: Config, layout) -> str:
    """Where a step's old log-probs come from: "rollout" (algorithm.rollout_correction.bypass_mode:
    the engine's own), "update" (the actor update's forward gives them exactly: one optimizer step
    per rollout batch, ppo_epochs 1 and one mini-batch, so the policy is unchanged until that forward,
    and nothing needs them before the update, as KL in the reward does, or the rollout correction's
    weights and rejections, rollout_is / rollout_rs, do, or an estimator reading the old policy's token
    statistics), else "pass" (a forward of their own)."""
    a, correction = cfg.actor, cfg.algorithm.rollout_correction
    if correction.bypass_mode:
        return "rollout"
    if (a.ppo_epochs == 1 and layout.actor_mini_batch_samples == layout.samples_per_step
            and not correction.corrects and not cfg.algorithm.use_kl_in_reward
            and cfg.algorithm.adv_estimator not in algos.TOKEN_STAT_ESTIMATORS):
        return "update"
    return "pass"


UPDATE_KEYS = ("input_ids", "attention_mask", "responses", "response_mask", "old_log_probs", "advantages",
               "ref_log_probs", "rollout_is_weights", "routed_experts")


def _surrogate(cfg: ActorConfig):
    """The policy loss of actor.policy_loss.loss_mode with this actor's clip settings."""
    mode, clip = cfg.policy_loss.loss_mode, dict(clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high)
    if mode == "gspo":
        return functools.partial(algos.gspo_policy_loss, **clip)
    if mode == "cispo":
        return functools.partial(token_losses.cispo_policy_loss, **clip)
    if mode == "gpg":
        return token_losses.gpg_policy_loss
    if mode == "dro":
        return functools.partial(token_losses.dro_policy_loss, beta=cfg.policy_loss.dro_beta)
    if mode == "geo_mean":
        return functools.partial(token_losses.geo_mean_policy_loss, **clip)
    if mode == "sapo":
        return functools.partial(token_losses.sapo_policy_loss, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)
    if mode in ("dppo_tv", "dppo_kl"):
        loss = token_losses.dppo_tv_policy_loss if mode == "dppo_tv" else token_losses.dppo_kl_policy_loss
        return functools.partial(loss, clip_c=cfg.clip_ratio_c, **clip)
    pl = cfg.policy_loss
    if mode == "clip_cov":
        return functools.partial(covariance_losses.clip_cov_policy_loss, cov_ratio=pl.clip_cov_ratio,
                                 cov_lb=pl.clip_cov_lb, cov_ub=pl.clip_cov_ub, **clip)
    if mode == "kl_cov":
        return functools.partial(covariance_losses.kl_cov_policy_loss, cov_ratio=pl.kl_cov_ratio, kl_coef=pl.ppo_kl_coef)
    return functools.partial(algos.policy_loss, clip_c=cfg.clip_ratio_c, **clip)


def _policy_agg(cfg: ActorConfig) -> str:
    """How the policy term's share of the mini-batch is counted: the loss's own aggregation (GMPO's and SAPO's are
    fixed)."""
    fixed = {"geo_mean": token_losses.GEO_MEAN_AGG, "sapo": token_losses.SAPO_AGG}
    return fixed.get(cfg.policy_loss.loss_mode, cfg.loss_agg_mode)


class ActorWorker(LogProbWorker):
    def __init__(self, engine: ModelEngine, optimizer, cfg: ActorConfig, vocab_size: int, temperature: float,
                 max_response_length: int):
        super().__init__(engine, vocab_size, temperature)
        self.optimizer, self.cfg = optimizer, cfg
        # seq-mean-token-sum-norm divides by a constant, never by a (trimmed) micro-batch's width
        self.loss_scale_factor = cfg.loss_scale_factor or max_response_length
        self.bypass: Optional[RolloutCorrectionConfig] = None
        """verl's bypass mode (set by the trainer): old log-probs are the engine's, and the loss corrects the
        current policy against them (`algos.bypass_mode_policy_loss`)."""

    def _policy_loss(self, mb, log_probs, old_log_probs):
        """(loss, token stats, rollout_corr/ metrics of bypass mode). Decoupled mode: the batch's IS weights
        (the trainer's rollout correction, if any) on the surrogate; its rejections are in the mask already."""
        cfg, mask, mode = self.cfg, mb["response_mask"], self.cfg.loss_agg_mode
        surrogate = _surrogate(cfg)
        common = dict(agg_mode=mode, loss_scale_factor=self.loss_scale_factor)
        if self.bypass is None:
            loss, stats = surrogate(old_log_probs, log_probs, mb["advantages"], mask,
                                    rollout_is_weights=mb.get("rollout_is_weights"), **common)
            return loss, stats, {}
        loss, stats, metrics, kept = algos.bypass_mode_policy_loss(
            old_log_probs, log_probs, mb["advantages"], mask, self.bypass.loss_type, self.bypass.kwargs(), surrogate,
            **common)
        # rejected tokens add nothing, but the normaliser stays the batch's (verl's global token / row counts)
        policy_mode = _policy_agg(cfg)  # GMPO's term counts rows, whatever loss_agg_mode
        before = algos.agg_loss_denominator(mask, policy_mode)
        return loss * (algos.agg_loss_denominator(kept, policy_mode) / before if before else 0.0), stats, metrics

    def _loss(self, tokens, mb, share: Share, n_micro: int):
        cfg = self.cfg
        mask = mb["response_mask"]
        log_probs, entropy = self._token_stats(tokens, mb)
        # Without old log-probs (one step on fresh data) the policy before this step is the current
        # one: its log-probs are this forward's, held constant.
        own_old = "old_log_probs" not in mb
        old_log_probs = log_probs.detach() if own_old else mb["old_log_probs"]
        pg_loss, stats, correction = self._policy_loss(mb, log_probs, old_log_probs)
        ent = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, self.loss_scale_factor)
        loss = pg_loss - cfg.entropy_coeff * ent if cfg.entropy_coeff != 0 else pg_loss
        metrics = {"actor/pg_loss": pg_loss, "actor/entropy_loss": ent}  # verl's name for the update's entropy
        if cfg.use_kl_loss:
            kl = algos.agg_loss(algos.kl_penalty(log_probs, mb["ref_log_probs"], cfg.kl_loss_type), mask,
                                cfg.loss_agg_mode, self.loss_scale_factor)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl
        # summed over micro-batches and DP later (device tensors, read once per step): losses by
        # their normaliser, token means by tokens
        metrics = {k: v.detach().double() * (share.policy if k == "actor/pg_loss" else share.loss)
                   for k, v in metrics.items()}
        metrics.update({f"actor/{k}": v.detach().double() * share.tokens for k, v in stats.items()})
        metrics.update({k: v * share.tokens for k, v in correction.items()})  # bypass: by micro-batch, as verl
        # The schedule divides by n_micro (and multiplies by CP) and DDP averages over DP x CP: undo both for a global mean.
        scaled = (loss * share.loss + pg_loss * (share.policy - share.loss)) * n_micro * self.engine.groups.dp
        out = {**metrics, "finite": torch.isfinite(loss.detach()).double()}
        if own_old:
            out["rows"] = {"log_probs": old_log_probs, "entropy": entropy.detach()}
        return scaled, out

    def update_policy(self, batch: Dict[str, torch.Tensor], mini_batch_rows: int, batching: MicroBatching,
                      apply: bool = True) -> Dict[str, float]:
        """ppo_epochs passes over mini-batches; mean metrics over optimizer steps. apply=False
        computes the same losses without backward or update (the dry run).

        Without batch["old_log_probs"] this must be one optimizer step (ppo_epochs 1, one mini-batch):
        it starts from the policy that the old log-probs are about, so its own forward gives them
        exactly; they are stored in batch["old_log_probs"], their entropy in batch["old_entropy"]."""
        self.engine.train(True)
        own_old = "old_log_probs" not in batch
        if own_old:
            check_one_step("old log-probs", "compute them with compute_log_prob", self.cfg.ppo_epochs,
                           batch["response_mask"].shape[0], mini_batch_rows)
        keys = [k for k in UPDATE_KEYS if k in batch]
        minis = mini_batches(batch, keys, mini_batch_rows, self.cfg.ppo_epochs)
        with RouterStats(self.engine.module) as routing:
            metrics, per_step = ppo_update(self.engine, self.optimizer, minis, batching, self.cfg.loss_agg_mode,
                                           self._loss, "actor", apply,
                                           self.token_fn(True, entropy_grad=self.cfg.entropy_coeff != 0),
                                           policy_agg=_policy_agg(self.cfg))
        if routing.routers:
            metrics.update(pass_metrics(routing, self.engine.groups, routing.routers[0].topk))
        if self.cfg.use_kl_loss:  # verl logs the coefficient beside actor/kl_loss
            metrics["actor/kl_coef"] = self.cfg.kl_loss_coef
        if own_old:
            batch["old_log_probs"], batch["old_entropy"] = per_step[0]["log_probs"], per_step[0]["entropy"]
        return metrics
