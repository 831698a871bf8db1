"""The PPO / GRPO loop. One step:

    rollout → reward (→ DAPO: drop all-equal groups, generate more) → old log-probs (actor)
    → ref log-probs → values (critic, PPO only) → KL penalty → rollout correction → advantages
    → critic update → actor update → weights into the rollout engine

Every rank runs this code (SPMD); each DP rank owns a slice of the prompts, and TP/PP peers hold
the same slice. Details live one level down: workers/, step_batch.py, roles.py, metrics.py,
dynamic_sampling.py (DAPO), validation.py (verl's val-core metrics).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict

import torch
import torch.distributed as dist

from hybridrl import algos
from hybridrl.config import Config
from hybridrl.log import warn_once
from hybridrl.trainer import generation_dump
from hybridrl.trainer.dynamic_sampling import sample_filtered
from hybridrl.placement.offload import Offloader, PhaseOffload
from hybridrl.metrics import StageTimer, batch_metrics, throughput_metrics
from hybridrl.rewards.overlong import overlong_penalty
from hybridrl.rewards.registry import RewardError, combine_scores
from hybridrl.rollout.agent_loop import (AgentLoop, trajectory_fields, trajectory_shapes, turn_metrics, turn_sums,
                                        verl_num_turns)
from hybridrl.rollout.base import SamplingParams
from hybridrl.timeline import Timeline
from hybridrl.trainer.rollout_correction import check_rollout_correction, correct_rollout
from hybridrl.trainer.split_perf import StepShares
from hybridrl.trainer.streamed import sample_streamed
from hybridrl.trainer.balance import balance_batch, balancing
from hybridrl.trainer.step_batch import (assemble, broadcast_rollout, gather_dp, gather_objects_dp, is_rollout_source,
                                         local_slice, once_per_replica, pad_columns, prompt_seeds, route_columns)
from hybridrl.trainer.estimator_inputs import estimator_inputs, keep_reward_components
from hybridrl.trainer.old_policy import old_policy_pass
from hybridrl.trainer.validation import metrics_from_samples
from hybridrl.workers.actor import old_log_prob_source
from hybridrl.workers.critic import values_source
from hybridrl.workers.engine import dp_sum
from hybridrl.config.batching import resolve_batching


class TrainingError(RuntimeError):
    """A run that cannot go on (NaN loss, broken checkpoint); the message names step and tensor."""


class PPOTrainer:
    def __init__(self, cfg: Config, layout, groups, tokenizer, roles, reward_fn, writer, remote=None):
        self.cfg, self.layout, self.groups, self.tok = cfg, layout, groups, tokenizer
        self.remote = remote
        """split placement: the rollout ranks (trainer.split.Pipeline); None when colocated."""
        self.version = 0
        """Policy version: the step whose update the actor's weights hold (0: the initial weights)."""
        self.gen_versions: list = []
        self.roles, self.reward_fn, self.writer = roles, reward_fn, writer
        self.actor, self.ref, self.critic, self.rollout = roles.actor, roles.ref, roles.critic, roles.rollout
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algos.make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.timer = StageTimer()
        # a span per phase: for trainer.timeline_dir, and (split) for the overlap of the two roles
        self.timeline = Timeline(dist.get_rank(), "trainer", bool(cfg.trainer.timeline_dir) or remote is not None)
        if self.timeline.enabled:
            at = self.timeline.at
            self.timer.on_span = lambda name, start, end: self.timeline.add(name, at(start), at(end))
            if remote is not None:  # time spent blocked on the other roles is idle, whatever stage holds it
                remote.client.on_wait = lambda start, end: self.timeline.add("wait_rollout", at(start), at(end))
            if layout.critic_world_size:
                roles.critic.on_wait = lambda start, end: self.timeline.add("wait_critic", at(start), at(end))
        self.shares = StepShares(self.timeline, remote.client, bool(cfg.trainer.timeline_dir)) \
            if remote is not None else None
        self.late_metrics = []
        """[(step, metrics)] of earlier steps known only now (split: perf/overlap, perf/idle/*)."""
        self.agent_loop = AgentLoop(cfg.rollout.multi_turn, tokenizer) if cfg.rollout.multi_turn.enable else None
        # hybrid engine: each phase keeps on the device only what it needs (offload.HYBRID_PHASES)
        self.hybrid = PhaseOffload({"actor": Offloader(self.actor.engine.module, self.actor.optimizer, cfg.actor.offload),
                                    "critic": Offloader(self.critic.engine.module, self.critic.optimizer,
                                                        cfg.critic.offload) if hasattr(self.critic, "engine") else None,
                                    "ref": self.ref and self.ref.offloader,
                                    "reward_model": roles.reward_model and roles.reward_model.offloader})
        self.batching = resolve_batching(cfg)
        self.replay_routes = cfg.actor.router_replay == "rollout"
        """MoE routing replay: the engine records its expert choices, the actor's forwards reuse them."""
        self.old_log_prob_source = old_log_prob_source(cfg, layout)
        check_rollout_correction(cfg, self.rollout)
        self.actor.bypass = cfg.algorithm.rollout_correction if self.old_log_prob_source == "rollout" else None
        self.values_source = values_source(cfg, layout) if self.critic is not None else None
        self.critic_apart = layout.critic_world_size > 0
        """The critic trains on ranks of its own: its values pass and update overlap the actor's."""
        if self.critic_apart:
            self.values_source = "pass"

    # ---- one step -------------------------------------------------------------------------
    def train_step(self, prompts, step: int, update: bool = True, next_prompts=None, upcoming=None) -> Dict[str, float]:
        """One PPO step; `next_prompts()` gives more prompt batches to DAPO's dynamic sampling; `upcoming`
        (split placement, staleness 1) is the next step's prompts, generated while this step trains."""
        cfg, t = self.cfg, self.timer
        t.reset()
        self.gen_versions = []
        step_start = time.perf_counter()
        actor_steps = step >= cfg.trainer.critic_warmup or self.critic is None  # verl's count, steps from 1
        source = self.old_log_prob_source
        if source == "update" and not actor_steps:
            source = "pass"
        batch, scores, sample_metrics = self.sample(prompts, step, next_prompts, source)
        if cfg.trainer.rollout_data_dir and update:  # not the dry run's
            with t("dump_rollout_generations"):
                generation_dump.dump_batch(cfg.trainer.rollout_data_dir, step, self.tok, batch, scores, self.step_rows,
                                           self.groups)
        if balancing(cfg):  # verl's: each DP rank's passes get about the same number of tokens
            with t("balance"):
                batch, scores, balanced = balance_batch(batch, scores, cfg.rollout.n, self.groups)
            sample_metrics.update(balanced)
        if self.remote is not None and upcoming is not None:
            with t("update_weights"):
                self.remote.prefetch(*self.rollout_request(upcoming, self.train_sampling(), step + 1))
        self.forward_passes(batch, source)
        with t("adv"):  # with values from the critic update, GAE follows it (finish_advantages)
            metrics = self.compute_advantages(batch, scores)
        metrics.update(sample_metrics)
        if self.critic_apart:  # sent now, answered after the actor's update: both updates run at once
            with t("update_critic"):
                self.critic.request_update(batch, apply=update)
        elif self.critic is not None:
            with t("update_critic"):
                self.hybrid.enter("update_critic")
                metrics.update(self.critic.update_critic(batch, self.layout.critic_mini_batch_samples // self.layout.dp,
                                                         self.batching.critic_update, apply=update))
            if "gae_advantages" in batch:
                with t("adv"):
                    metrics.update(self.finish_advantages(batch, scores))
        if actor_steps:  # with source "update", the update's forward also gives batch["old_log_probs"]
            with t("update_actor"):
                self.hybrid.enter("update_actor")
                metrics.update(self.actor.update_policy(batch, self.layout.actor_mini_batch_samples // self.layout.dp,
                                                        self.batching.actor_update, apply=update))
            if source == "update":  # nothing to correct (old_log_prob_source): the gap is measured now
                metrics.update(correct_rollout(batch, gather_dp(batch["response_mask"], self.groups),
                                               cfg.algorithm.rollout_correction, self.groups)[1])
        if self.critic_apart:
            with t("update_critic"):
                metrics.update(self.critic.update_metrics())
        if update:
            self.version = step
            with t("update_weights"):
                sync = self.sync_rollout_weights(now=False)  # a HandoffReport, or split placement's metrics
            metrics.update(sync.metrics() if hasattr(sync, "metrics") else sync)
        t.seconds["step"] = time.perf_counter() - step_start
        metrics.update(self.rollout_metrics(batch, batch.get("old_entropy")))
        if "actor/entropy" not in metrics and "actor/entropy_loss" in metrics:
            metrics["actor/entropy"] = metrics["actor/entropy_loss"]  # bypass: no pass gave the old policy's
        metrics.update(self.staleness_metrics(step))
        if self.shares is not None:  # the previous step's figures: its rollout spans came with this batch
            at = self.timeline.at
            self.late_metrics += self.shares.ended(step, at(step_start), at(step_start + t.seconds["step"]))
            metrics.update(self.shares.rows_bytes(step, self.critic, self.groups.device))
        metrics.update(t.metrics())
        return metrics

    def forward_passes(self, batch, source: str) -> None:
        """Old log-probs (from the engine, or a pass of their own), reference log-probs and values, each
        where the step needs it and the batch does not hold it yet (a streamed step ran them per chunk)."""
        t = self.timer
        values_apart = self.critic_apart and self.values_source == "pass" and "values" not in batch
        if values_apart:  # the critic ranks compute while this rank runs the actor's passes
            self.critic.request_values(batch)
        if source == "rollout":
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif source == "pass" and "old_log_probs" not in batch:
            with t("old_log_prob"):
                self.hybrid.enter("old_log_prob")
                old_policy_pass(self.actor, batch, self.batching.actor_log_prob, self.cfg.algorithm.adv_estimator)
        if self.ref is not None and "ref_log_probs" not in batch:
            with t("ref"):
                self.hybrid.enter("ref")
                batch["ref_log_probs"], _ = self.ref.compute_log_prob(batch, self.batching.ref_log_prob)
        if self.values_source == "pass" and "values" not in batch:
            with t("values"):
                self.hybrid.enter("values")
                batch["values"] = self.critic.values() if values_apart else \
                    self.critic.compute_values(batch, self.batching.critic_values)

    def train_sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=self.cfg.data.max_response_length,
                              stop_token_ids=self.tok.eos_token_ids, ignore_eos=r.ignore_eos, seed=r.seed)

    def generate(self, prompts, sampling: SamplingParams, step: int) -> Dict[str, torch.Tensor]:
        """Responses for this rank's prompts, padded to max_response_length, on the run's device.

        One rank of each model replica generates (every rank still enters the engine, which may be
        collective) and broadcasts the result to its TP/PP peers.
        """
        if self.remote is not None:
            return self.assemble_batch(prompts, sampling, self._remote_output(prompts, sampling, step), True)
        source = is_rollout_source(self.groups)
        ids = [row[m.bool()].tolist() for row, m in zip(prompts.input_ids, prompts.attention_mask)] if source else []
        seeds = prompt_seeds(sampling.seed, step, prompts.index) if source else []
        if getattr(self.rollout, "needs_weights", False):  # vLLM slept at level 2 since the last sync (a second
            with self.timer("update_weights"):             # generation: validation, ReMax's baseline, DAPO)
                self.sync_rollout_weights()
        self.hybrid.enter("gen")  # hybrid engine: the idle training state leaves the device
        if torch.cuda.is_available() and self.cfg.rollout.name == "vllm":
            torch.cuda.empty_cache()  # vLLM's sleep-mode pool allocates outside torch's cache
        with self.timer("generate_sequences"):  # the engine's window, once the idle state is offloaded
            self.rollout.wake_up()
            if self.agent_loop is not None:  # multi-turn: trajectories of model turns and tool results
                out = self.agent_loop.generate(self.rollout, ids, sampling, seeds)
            else:
                out = self.rollout.generate(ids, sampling, seeds)
            if self.cfg.rollout.free_cache_engine:
                self.rollout.sleep()
        return self.assemble_batch(prompts, sampling, out, source)

    def rollout_request(self, prompts, sampling: SamplingParams, step: int):
        """(prompt token ids, seeds, sampling, key) of a request to the rollout ranks."""
        ids = [row[m.bool()].tolist() for row, m in zip(prompts.input_ids, prompts.attention_mask)]
        return ids, prompt_seeds(sampling.seed, step, prompts.index), sampling, (step, tuple(prompts.index), sampling)

    def _remote_output(self, prompts, sampling: SamplingParams, step: int):
        """Split placement: this rank's responses from the rollout ranks (prefetched, or asked for now)."""
        with self.timer("generate_sequences"):
            out, versions = self.remote.generate(*self.rollout_request(prompts, sampling, step))
        if sampling == self.train_sampling():
            self.gen_versions += versions.tolist()
        return out

    def assemble_batch(self, prompts, sampling: SamplingParams, out, source: bool) -> Dict[str, torch.Tensor]:
        """The step batch from the engine's output (on the source rank; broadcast to its replica)."""
        R = self.cfg.data.max_response_length
        rows, device = len(prompts) * sampling.n, self.groups.device
        mine = None
        if source:
            mine = {"responses": pad_columns(out.responses.to(device), R, self.tok.pad_token_id),
                    "response_mask": pad_columns(out.response_mask.to(device, torch.float32), R, 0.0),
                    "rollout_log_probs": pad_columns(out.log_probs.to(device, torch.float32), R, 0.0)}
            if self.cfg.rollout.multi_turn.enable:
                mine.update(trajectory_fields(out, R, device))
            if self.replay_routes:
                mine["routed_experts"] = route_columns(out.routed_experts.to(device), out.responses.shape[1],
                                                       prompts.input_ids.shape[1], R)
        extra = trajectory_shapes(rows, R) if self.cfg.rollout.multi_turn.enable else {}
        if self.replay_routes:
            extra["routed_experts"] = ((rows, prompts.input_ids.shape[1] + R, self.roles.spec.num_layers,
                                        self.roles.spec.moe_topk), torch.int32)  # gloo has no int16
        rollout = mine if self.remote is not None else broadcast_rollout(mine, rows, R, self.groups, extra)
        batch = assemble(prompts.input_ids, prompts.attention_mask, rollout["responses"], rollout["response_mask"],
                         sampling.n, device, rollout.get("attention_mask"))
        batch["rollout_log_probs"] = rollout["rollout_log_probs"]
        batch.update({k: rollout[k] for k in extra if k != "attention_mask"})
        return batch

    def sample(self, prompts, step: int, next_prompts=None, source: str = "pass"):
        """(batch, scores, metrics) of this step: one generation batch, DAPO's dynamic sampling, or (split
        placement with stream_prompts) chunks scored and passed forward as they arrive."""
        self.step_rows = None  # with trainer.rollout_data_dir: (ground truth, reward extras) per row, global order
        if self.remote is not None and self.cfg.async_training.stream_prompts:
            return (*sample_streamed(self, prompts, step, source), {})
        scored = []  # with a dump: each generation batch's RowInfo

        def generate_and_score(p):
            with self.timer("gen"):
                batch = self.generate(p, self.train_sampling(), step)
            if self.cfg.algorithm.adv_estimator == "remax":
                batch["baseline_scores"] = self.remax_baselines(p, step)
            with self.timer("reward"):
                out = (batch, *self.score_details(batch, p, self.cfg.rollout.n))
                keep_reward_components(batch, out[3], self.cfg.algorithm)
            if self.cfg.trainer.rollout_data_dir:
                scored.append(generation_dump.RowInfo.of([g for g in p.ground_truth for _ in range(self.cfg.rollout.n)], out[3]))
            return out

        if not self.cfg.algorithm.filter_groups.enable:
            batch, scores, _, _ = generate_and_score(prompts)
            if scored:
                self.step_rows = gather_objects_dp(scored[-1].rows(), self.groups)
            return batch, scores, {}
        kept = [] if self.cfg.trainer.rollout_data_dir else None
        out = sample_filtered(generate_and_score, prompts, next_prompts, self.cfg, self.groups, self.tok.pad_token_id,
                              step, rows_of=lambda: scored[-1].rows(), kept_rows=kept)
        self.step_rows = kept
        return out

    def remax_baselines(self, prompts, step: int) -> torch.Tensor:
        """ReMax's baseline: the score of one greedy response per prompt (as verl: the same reward,
        rollout.n copies per prompt, one per sample)."""
        sampling = dataclasses.replace(self.train_sampling(), n=1, temperature=0.0, top_p=1.0, top_k=-1)
        with self.timer("gen"):
            greedy = self.generate(prompts, sampling, step)
        with self.timer("reward"):
            scores = self.score_details(greedy, prompts, 1)[0]
        return scores.repeat_interleave(self.cfg.rollout.n)

    def score_details(self, batch, prompts, n: int, use_reward_model: bool = True):
        """(scores, scores before overlong shaping, the rule reward's extra values per response).

        Rule scores of the decoded responses (of a multi-turn trajectory, its final model turn: the
        answer); with a reward model (training only) its scores, kept in batch["rm_scores"], replace
        them or are added to them (reward_model.combine); then DAPO's overlong penalty
        (reward.overlong_buffer) when enabled. Scores are on the run's device."""
        responses = batch["responses"].cpu()  # one copy to the host
        real = batch["attention_mask"][:, -responses.shape[1]:].cpu()  # the response's real tokens (verl)
        decode = lambda masks: [self.tok.decode(r[m.bool()].tolist()) for r, m in zip(responses, masks)]
        texts = decode(real)
        answers = decode(batch["last_turn_mask"].cpu()) if "last_turn_mask" in batch else texts
        rep = lambda xs: [x for x in xs for _ in range(n)]
        rm, combine = (self.roles.reward_model if use_reward_model else None), self.cfg.reward_model.combine
        rule, infos = None, {}
        if rm is None or combine == "add":
            # as verl's reward managers: each response's extra_info gets its trajectory's turn count (verl's
            # count) and the engine's own scores (none here)
            extra = [{**info, "num_turns": turns, "rollout_reward_scores": {}}
                     for info, turns in zip(rep(prompts.extra_info), verl_num_turns(batch, real))]
            rule, infos = once_per_replica(lambda: self.reward_fn.score_batch(  # once per row: a judge's verdict
                answers, rep(prompts.data_source), rep(prompts.ground_truth), extra), self.groups, RewardError)
            rule = _finite(rule, "reward function").to(self.groups.device, torch.float32)
        raw = rule
        if rm is not None:
            self.hybrid.enter("reward")
            batch["rm_scores"] = _finite(rm.compute_rm_score(batch, rep(prompts.messages), texts), "reward model")
            raw = combine_scores(rule, batch["rm_scores"], combine).to(self.groups.device)
        buffer = self.cfg.reward.overlong_buffer
        if not buffer.enable:
            return raw, raw, infos
        penalty = overlong_penalty(real.sum(-1), self.cfg.data.max_response_length, buffer.len, buffer.penalty_factor)
        return raw + penalty.to(raw.device), raw, infos

    def _token_rewards(self, batch, scores):
        """(DP-global scores, token rewards with the KL penalty when it is in the reward, mask, metrics)."""
        a, g = self.cfg.algorithm, self.groups
        mask = gather_dp(batch["response_mask"], g)
        all_scores = gather_dp(scores, g)
        token_rewards = algos.token_rewards_from_scores(all_scores, mask)
        metrics = {}
        if a.use_kl_in_reward:
            token_rewards, kl = algos.apply_kl_penalty(
                token_rewards, gather_dp(batch["old_log_probs"], g), gather_dp(batch["ref_log_probs"], g),
                mask, self.kl_ctrl.value, a.kl_penalty)
            metrics.update({"actor/reward_kl_penalty": float(kl), "actor/reward_kl_penalty_coeff": self.kl_ctrl.value})
            # as verl's apply_kl_penalty: n_steps is the batch's responses (prompts x rollout.n), not its prompts
            self.kl_ctrl.update(float(kl), n_steps=mask.shape[0])
        return all_scores, token_rewards, mask, metrics

    def compute_advantages(self, batch, scores) -> Dict[str, float]:
        """KL-in-reward and advantages over the DP-global batch; each rank keeps its slice. With the
        values still to come from the critic update (values_source "update"), only the token rewards
        (batch["token_rewards"]); `finish_advantages` follows the update."""
        a, g = self.cfg.algorithm, self.groups
        all_scores, token_rewards, mask, metrics = self._token_rewards(batch, scores)
        if "old_log_probs" in batch and self.old_log_prob_source != "rollout":  # verl's decoupled mode
            mask, corrected = correct_rollout(batch, mask, a.rollout_correction, g)  # rejections: mask replaced
            metrics.update(corrected)
        if self.values_source == "update":
            batch["token_rewards"] = local_slice(token_rewards, g)
            return metrics
        values = gather_dp(batch["values"], g) if "values" in batch else None
        baselines = gather_dp(batch["baseline_scores"], g) if "baseline_scores" in batch else None
        group_index = (torch.arange(mask.shape[0]) // self.cfg.rollout.n).tolist()
        # the outcome estimators (GRPO, RLOO, ...) take each row's summed token rewards, as verl's do: with the
        # KL penalty in the reward that is the score minus it (over the mask from before any rejection)
        outcome = token_rewards.sum(-1) if a.use_kl_in_reward else all_scores
        adv, returns = algos.compute_advantages(
            a.adv_estimator, token_rewards=token_rewards, scores=outcome, values=values, response_mask=mask,
            group_index=group_index, gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_adv_by_std_in_grpo,
            baseline_scores=baselines, **estimator_inputs(a, batch, g))
        if baselines is not None:  # ReMax: the greedy responses' mean score, what the samples are measured against
            metrics["critic/remax_baseline/mean"] = baselines.mean().item()
        return {**metrics, **self._advantage_metrics(batch, all_scores, token_rewards, adv, returns, mask, values)}

    def finish_advantages(self, batch, scores) -> Dict[str, float]:
        """GAE from the values and per-row raw advantages the critic update's forward gave: the same
        whitening over the DP-global batch as `algos.compute_gae_advantages`."""
        g = self.groups
        mask = gather_dp(batch["response_mask"], g)
        raw = gather_dp(batch.pop("gae_advantages"), g)
        adv = algos.masked_whiten(raw, mask) * mask
        returns, values = gather_dp(batch["returns"], g), gather_dp(batch["values"], g)
        token_rewards = gather_dp(batch.pop("token_rewards"), g)
        return self._advantage_metrics(batch, gather_dp(scores, g), token_rewards, adv, returns, mask, values)

    def _advantage_metrics(self, batch, all_scores, token_rewards, adv, returns, mask, values) -> Dict[str, float]:
        """Keep this rank's slice of advantages and returns; verl's data metrics of the step."""
        g = self.groups
        batch["advantages"], batch["returns"] = local_slice(adv, g), local_slice(returns, g)
        prompt_mask = gather_dp(batch["prompt_mask"], g)
        R = self.cfg.data.max_response_length
        rm_scores = gather_dp(batch["rm_scores"], g) if "rm_scores" in batch else None
        real = gather_dp(batch["attention_mask"][:, -R:], g)
        return batch_metrics(all_scores, token_rewards, adv, returns, mask, R, prompt_mask, values,
                             rm_scores, response_attention_mask=real, max_prompt_length=self.cfg.data.max_prompt_length)

    def rollout_metrics(self, batch, entropy=None) -> Dict[str, float]:
        """Engine-vs-trainer log-prob agreement and the old policy's entropy, when a trainer pass computed
        the old log-probs (entropy given); in bypass mode the engine's are the old ones: neither is measured."""
        g, mask = self.groups, batch["response_mask"]
        measured = entropy is not None
        diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask if measured else mask * 0
        sums = dp_sum({"tokens": batch["attention_mask"].sum().item(), "generated": mask.sum().item(),
                       "diff": diff.sum().item(), "entropy": (entropy * mask).sum().item() if measured else 0.0,
                       **turn_sums(batch)}, g)
        generated = max(sums["generated"], 1.0)
        out = {"perf/rollout_tokens": sums["generated"], **turn_metrics(sums)}
        if measured:
            out.update({"rollout/logprob_diff_mean": sums["diff"] / generated,
                        "rollout/logprob_diff_max": gather_dp(diff.max().reshape(1), g).max().item(),
                        "actor/entropy": self._old_entropy(entropy, mask)})
        n_tokens = sums["tokens"]
        out.update(throughput_metrics(self.timer.metrics(), int(n_tokens), dist.get_world_size()))
        return out

    def _old_entropy(self, entropy, mask) -> float:
        """verl's actor/entropy: the old policy's entropy (the pass that gave the old log-probs, before any update)
        reduced as the loss is (actor.loss_agg_mode) over the DP-global batch."""
        a = self.cfg.actor
        return algos.agg_loss(gather_dp(entropy.float(), self.groups), gather_dp(mask.float(), self.groups),
                              a.loss_agg_mode, a.loss_scale_factor or self.cfg.data.max_response_length).item()

    def staleness_metrics(self, step: int) -> Dict[str, float]:
        """Split placement: how many updates behind the trained policy its samples were generated."""
        if self.remote is None or not self.gen_versions:
            return {}
        behind = [step - 1 - v for v in self.gen_versions]
        return {"rollout/staleness/mean": sum(behind) / len(behind), "rollout/staleness/max": float(max(behind)),
                "timing_s/wait_rollout": self.remote.client.take_wait()}

    def sync_rollout_weights(self, now: bool = True):
        """The actor's weights into the engine, grads and optimizer states offloaded (idle until the
        next update): the sync holds two weight copies and one bucket, or one copy where the engine reads
        the actor's own tensors (shared: generation then keeps them on the device). Split placement: to
        the rollout ranks, at once (`now`, or staleness 0) or once the batch in flight has arrived."""
        from hybridrl.models.lora import merged_weights
        from hybridrl.placement.reshard import update_engine_weights

        if self.remote is not None:
            return self.remote.updated(self.actor.engine.module, self.version, now=now,
                                       onload=lambda: self.hybrid.enter("update_weights"))
        self.hybrid.enter("update_weights")
        r = self.cfg.rollout
        with merged_weights(self.actor.engine.module):  # LoRA: the engine gets W + s B A, one tensor at a time
            report = update_engine_weights(self.rollout, self.actor.engine.module, self.roles.spec, self.groups,
                                           r.update_weights_bucket_mb, verify=r.verify_weights,
                                           share=r.share_weights and not self.cfg.actor.lora.enabled)
        self.hybrid.engine_reads = {"actor"} if report.shared or report.stage_shared else set()
        return report

    # ---- validation -----------------------------------------------------------------------
    def val_sampling(self) -> SamplingParams:
        vk = self.cfg.rollout.val_kwargs
        greedy = vk.temperature == 0  # as verl 0.9.1: do_sample is not read
        if not greedy and not vk.do_sample:
            warn_once(f"rollout.val_kwargs.do_sample=false is not read (as in verl 0.9.1): validation samples at "
                      f"temperature {vk.temperature:g}; set rollout.val_kwargs.temperature=0 for greedy")
        return SamplingParams(n=vk.n, temperature=0.0 if greedy else vk.temperature, top_p=1.0 if greedy else vk.top_p,
                              top_k=-1 if greedy else vk.top_k, max_new_tokens=self.cfg.data.max_response_length,
                              stop_token_ids=self.tok.eos_token_ids, ignore_eos=self.cfg.rollout.ignore_eos,
                              seed=self.cfg.rollout.seed)

    def validate(self, val_loader, step: int = 0) -> Dict[str, float]:
        """verl's validation metrics (val-core/<data_source>/<var>/mean@N, best@N, maj@N; val-aux/...; multi-turn:
        val-aux/num_turns/min, max and mean over every response); the responses to trainer.validation_data_dir
        and trainer.log_val_generations (generation_dump.publish_validation)."""
        sampling = self.val_sampling()
        samples = []  # (data_source, prompt uid, {var: value}) per response, in this rank's order
        turns = []  # multi-turn: each response's model turns (rollout/num_turns' count)
        keep, dump = self.cfg.trainer.validation_data_dir or self.cfg.trainer.log_val_generations, []
        # every rank joins each batch, its shard empty or not: the engine's TP group can span DP ranks (rollout TP
        # > training TP) and decodes their prompts as one batch; split placement's requests are collective too
        for b, prompts in enumerate(val_loader):
            batch = self.generate(prompts, sampling, step=-1)
            if "num_turns" in batch:
                turns += batch["num_turns"].tolist()
            scores, _, infos = self.score_details(batch, prompts, sampling.n, use_reward_model=False)  # rule-checked
            if keep:
                gts = [g for g in prompts.ground_truth for _ in range(sampling.n)]
                dump += generation_dump.lines_of(self.tok, batch, scores, generation_dump.RowInfo.of(gts, infos))
            for i, score in enumerate(scores.tolist()):
                p = i // sampling.n
                values = {"reward": score, **{k: v[i] for k, v in infos.items()}}
                # one uid per val row (verl: a uuid each): its rank, batch and place
                samples.append((prompts.data_source[p], (self.groups.dp_rank, b, p), values))
        metrics = metrics_from_samples(gather_objects_dp(samples, self.groups))
        if keep:
            generation_dump.publish_validation(self.cfg.trainer, step, dump, self.groups, self.writer)
        turns = gather_objects_dp(turns, self.groups)
        if turns:  # as verl's val-aux/num_turns/{min,max,mean}
            metrics.update({"val-aux/num_turns/min": float(min(turns)), "val-aux/num_turns/max": float(max(turns)),
                            "val-aux/num_turns/mean": sum(turns) / len(turns)})
        return metrics


def _finite(scores: torch.Tensor, source: str) -> torch.Tensor:
    if not torch.isfinite(scores).all():
        raise TrainingError(f"{source} returned a non-finite score")
    return scores
