"""Set up a run and drive PPOTrainer over steps: resume, validation, checkpoints, profile, dry run."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from hybridrl.checkpoint import CheckpointManager, CheckpointWriter, choose_checkpoint, load_checkpoint, naming_damage
from hybridrl.checkpoint.writer import layout_of
from hybridrl.config import Config
from hybridrl.log import print0, setup_logging
from hybridrl.metrics import throughput_metrics
from hybridrl.parallel import liveness
from hybridrl.trainer.ppo import PPOTrainer, TrainingError
from hybridrl.trainer.prompt_feed import PromptFeed, endless

CONSOLE_KEYS = ("critic/score/mean", "critic/rm_score/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl",
                "actor/grad_norm", "critic/vf_loss", "response_length/mean", "rollout/logprob_diff_mean",
                "rollout/num_turns/mean", "rollout/tool_calls/mean", "rollout/tool_errors/mean",
                "train/num_gen_batches", "timing_s/step")


def _validates_at(step: int, total: int, test_freq: int) -> bool:
    """As verl's trainers: test_freq > 0, every test_freq steps and at the last; 0 or below (verl's -1), never
    during training (trainer.val_before_train still validates before it)."""
    return test_freq > 0 and (step == total or step % test_freq == 0)


def _val_core(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("val-core/")}


def _total_steps(cfg: Config, loader) -> int:
    """The steps the LR schedule runs over (and the critic's): trainer.total_training_steps, or with 0 (verl's
    null) total_epochs passes over the data."""
    return cfg.trainer.total_training_steps or len(loader) * cfg.trainer.total_epochs


def _run_steps(cfg: Config, loader) -> int:
    """The steps the run lasts, as verl's trainer loops: the schedule's steps, ended early when total_epochs
    passes over the data are done (a set total_training_steps beyond them does not reuse the data)."""
    return min(_total_steps(cfg, loader), len(loader) * cfg.trainer.total_epochs)


def _checkpointed_roles(roles) -> dict:
    """The roles this world writes into a checkpoint: {"actor": ActorWorker, "critic": CriticWorker (PPO
    only, unless the critic has ranks of its own)}."""
    return {name: w for name, w in (("actor", roles.actor), ("critic", roles.critic))
            if w is not None and hasattr(w, "engine")}


def _remote_roles(roles) -> dict:
    """Roles that other ranks save: {"critic": RemoteCritic} in split placement with a critic group."""
    return {"critic": roles.critic} if roles.critic is not None and not hasattr(roles.critic, "engine") else {}


IN_FLIGHT = "in_flight.pt"
"""Split placement at staleness 1: the next step's batch, generated but not trained when the checkpoint was taken."""


def _save(saver: CheckpointWriter, trainer, data_state: dict, step: int) -> None:
    from hybridrl.models.hf_config import load_hf_config

    from hybridrl.models.lora_export import lora_meta

    meta = {"data": data_state, "kl_coef": trainer.kl_ctrl.value, "layout": layout_of(trainer.groups),
            "hf_config": load_hf_config(trainer.roles.hf_folder), **lora_meta(trainer.actor.engine.module)}
    in_flight = trainer.remote.in_flight() if trainer.remote is not None else None
    saver.save(step, _checkpointed_roles(trainer.roles), meta, {IN_FLIGHT: in_flight},
               others={name: r.save for name, r in _remote_roles(trainer.roles).items()})


def _profile_line(step: int, m: dict) -> str:
    t = lambda k: max(m.get(f"timing_s/{k}", 0.0), 1e-9)
    tokens = m.get("perf/total_num_tokens", 0.0)
    actor_s = t("old_log_prob") + t("update_actor")
    line = f"[STEP {step}] Rollout: {m.get('perf/rollout_tokens', 0) / t('gen'):.0f} tokens/s | Actor: {tokens / actor_s:.0f} tokens/s"
    critic = f"{tokens / (t('values') + t('update_critic')):.0f} tokens/s" if "timing_s/update_critic" in m else "n/a"
    overlap = f" | Overlap: {m['perf/overlap']:.0%}" if "perf/overlap" in m else ""
    return line + f" | Critic: {critic} | Total: {t('step'):.2f} s/step" + overlap


def setup_run(cfg: Config):
    """Process groups, tokenizer, layout and data loaders of one run (the RL trainer's, and the
    reward-model trainer's, which shares them): (launch env, tokenizer, layout, groups, train, val)."""
    from hybridrl.data.prompts import make_train_loader, make_val_loader
    from hybridrl.data.synthetic import ensure_synthetic_data
    from hybridrl.config.layout import derive_layout
    from hybridrl.parallel.distributed import agreed_random_seed, init_distributed, init_model_parallel
    from hybridrl.tokenizer import load_data_tokenizer

    setup_logging()
    le = init_distributed(cfg.trainer.dist_timeout_s)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = load_data_tokenizer(cfg.data, cfg.model.path)
    layout = derive_layout(cfg, le.world_size, tokenizer.vocab_size)
    groups = init_model_parallel(layout.tp, layout.pp, seed=cfg.trainer.seed, ep=layout.ep, cp=layout.cp)
    if le.rank == 0:
        ensure_synthetic_data(cfg.data)
    dist.barrier()
    drawn = agreed_random_seed() if cfg.data.seed is None else None
    train_loader = make_train_loader(cfg.data, tokenizer, groups.dp_rank, groups.dp, drawn)
    val_loader = make_val_loader(cfg.data, tokenizer, groups.dp_rank, groups.dp) if cfg.data.val_files else None
    return le, tokenizer, layout, groups, train_loader, val_loader


def open_writer(cfg: Config, enabled: bool, suffix: str = "", sinks=None):
    """The run's metric writer: `trainer.logger` (or `sinks`) under log_dir/project/experiment+suffix, with
    the resolved config for W&B. Made before any model, so a sink that cannot start fails in seconds."""
    from hybridrl.metrics import MetricsWriter

    tc = cfg.trainer
    experiment = tc.experiment_name + suffix
    return MetricsWriter(tc.logger if sinks is None else sinks, os.path.join(tc.log_dir, tc.project_name, experiment),
                         enabled, project=tc.project_name, experiment=experiment, config=dataclasses.asdict(cfg))


def start_split(cfg: Config):
    """Split placement: this rank's role world (None when colocated); a rollout rank serves the trainers
    here and returns its exit code instead."""
    if cfg.placement.mode != "split":
        return None, None
    from hybridrl.config.layout import split_ranks
    from hybridrl.parallel.distributed import launch_env
    from hybridrl.parallel.split_world import init_split_world
    from hybridrl.trainer.split import serve_rollout

    le = launch_env()
    world = init_split_world(le, split_ranks(cfg, le.world_size), cfg.trainer.dist_timeout_s,
                             cfg.placement.critic_world_size)
    if world.role == "train":
        return world, None
    from hybridrl.trainer.preemption import ignore_stop_signals
    from hybridrl.trainer.split_critic import serve_critic

    setup_logging()
    ignore_stop_signals()
    try:
        return world, (serve_rollout if world.role == "rollout" else serve_critic)(cfg, world)
    finally:
        liveness.stop()


def main_loop(cfg: Config, dry_run: bool = False, profile: bool = False) -> int:
    world, served = start_split(cfg)
    if served is not None:
        return served
    le, tokenizer, layout, groups, train_loader, val_loader = setup_run(cfg)
    remote, done = None, False
    try:
        if world is not None:
            from hybridrl.trainer.split import Pipeline, RolloutClient

            remote = Pipeline(RolloutClient(cfg, world, groups, _spec(cfg, tokenizer, groups), tokenizer.pad_token_id),
                              cfg.async_training.staleness_threshold, cfg.async_training.partial_rollout)
        code = _train(cfg, le, tokenizer, layout, groups, train_loader, val_loader, remote, dry_run, profile, world)
        done = True
        return code
    finally:
        _stop_rollout(remote, done)
        liveness.stop()


def _stop_rollout(remote, done: bool) -> None:
    """Release the rollout ranks: after a clean run, and after a trainer error too (so they do not wait
    for requests that never come), unless the conversation itself is what broke."""
    if remote is None:
        return
    from hybridrl.trainer.split import PeerLostError

    try:
        remote.stop()
    except (PeerLostError, RuntimeError):
        if done:
            raise


def _spec(cfg: Config, tokenizer, groups):
    from hybridrl.models.hf_config import load_hf_config, spec_from_hf_config
    from hybridrl.trainer.roles import init_model_folder

    return spec_from_hf_config(load_hf_config(init_model_folder(cfg, tokenizer.vocab_size)))


def _train(cfg: Config, le, tokenizer, layout, groups, train_loader, val_loader, remote, dry_run, profile,
           world=None) -> int:
    from hybridrl.config.io import to_yaml
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles

    tc = cfg.trainer
    ckpt = CheckpointManager(tc.checkpoint_dir, {"actor": tc.max_actor_ckpt_to_keep,
                                                    "critic": tc.max_critic_ckpt_to_keep})
    # a bad path or no intact checkpoint fails before any model is built
    resume_from = None if dry_run else choose_checkpoint(ckpt, tc.resume_mode, tc.verify_checkpoint_digests)
    print0(to_yaml(cfg))
    print0(f"layout: {layout.describe()}")
    total = _total_steps(cfg, train_loader)
    writer = open_writer(cfg, le.rank == 0, sinks=["console"] if dry_run else None)
    roles = build_roles(cfg, groups, tokenizer, total, with_engine=remote is None,
                        with_critic=not layout.critic_world_size)
    if layout.critic_world_size:  # a critic of its own: served by the critic ranks
        from hybridrl.trainer.split_critic import RemoteCritic

        roles.critic = RemoteCritic(world, groups, roles.hf_folder, total)
    trainer = PPOTrainer(cfg, layout, groups, tokenizer, roles, RewardManager(cfg.reward), writer, remote)
    saver = CheckpointWriter(ckpt, tc.async_save)
    if dry_run:
        trainer.sync_rollout_weights()
        code = _dry_run(trainer, train_loader, layout, cfg)
        if layout.critic_world_size:
            roles.critic.stop()
        return code
    start = _resume(trainer, resume_from, train_loader)
    writer.resumed_at(start)  # a fresh start (0) too: what an earlier attempt logged in these sinks goes
    trainer.sync_rollout_weights()  # the starting weights, fresh or resumed: sent once
    val_history = []  # (step, validation metrics) of every validation, for the closing trend
    if val_loader is not None and tc.val_before_train:  # resumed too, at the step resumed from (as verl)
        val_history.append((start, trainer.validate(val_loader, start)))
        writer.log(val_history[-1][1], start, tuple(_val_core(val_history[-1][1])))
    from hybridrl.trainer.watchdog import Watchdog

    watchdog = Watchdog(tc.hang_timeout_s, tc.log_dir, dist.get_rank())
    trainer.timer.on_enter, trainer.timer.on_leave = watchdog.enter, watchdog.leave
    last = _run_steps(cfg, train_loader)
    if tc.val_only:  # verl's evaluation run: the validation above, then the run ends (no step, no checkpoint)
        last = start
    elif last < total:
        print0(f"trainer.total_epochs={tc.total_epochs} over {len(train_loader)} batches ends the run at step {last}, "
               f"before trainer.total_training_steps={total} (as verl); raise total_epochs to run them all")
    with _naming_dead_ranks(watchdog):
        return _steps(cfg, le, trainer, layout, groups, train_loader, val_loader, ckpt, saver, watchdog, start,
                      last, writer, remote, profile, val_history)


@contextlib.contextmanager
def _naming_dead_ranks(watchdog):
    """A collective broken by a dead peer ends the run with `rank R died during <phase>` (PeerLostError)."""
    from hybridrl.parallel.liveness import Heartbeats, is_peer_lost
    from hybridrl.trainer.split import PeerLostError

    own = liveness.beating() is None and dist.get_world_size() > 1  # split placement: every rank beats already
    beats = Heartbeats() if own else liveness.beating()
    try:
        yield
    except Exception as err:
        if beats is None or not is_peer_lost(err):
            raise
        phase, dead = watchdog.failed_in or watchdog.phase, beats.stopped()
        who = f"rank {', '.join(map(str, dead))}" if dead else "a peer rank"
        raise PeerLostError(f"{who} died during {phase} ({str(err).splitlines()[0][:160]}); the job stops: "
                            "resume from the last checkpoint (trainer.resume_mode=auto)") from None
    finally:
        if own:
            beats.close()


def _steps(cfg: Config, le, trainer, layout, groups, train_loader, val_loader, ckpt, saver, watchdog, start, total,
           writer, remote, profile, val_history) -> int:
    """The training steps from `start` + 1, checkpoints and stop requests included; the closing trends."""
    from hybridrl.trainer.preemption import STOP_FILE, StopRequests, deadline, saves_at

    tc = cfg.trainer
    stops = StopRequests(os.path.join(tc.checkpoint_dir, STOP_FILE), deadline(tc.max_runtime, tc.stop_margin_s))
    stops.clear_stop_file(ckpt.latest())
    code = 0
    bar = _progress(total, start, tc.progress_bar and le.rank == 0)
    profile_steps, rewards, tool_calls = [], [], []
    ahead = remote is not None and cfg.async_training.staleness_threshold > 0
    feed = PromptFeed(train_loader, ahead)
    for step in range(start + 1, total + 1):
        watchdog.step(step)
        prompts = feed.step_prompts(prefetch=ahead and step < total)
        try:
            metrics = trainer.train_step(prompts, step, next_prompts=feed.more,
                                         upcoming=feed.upcoming)
        except FloatingPointError as err:
            raise TrainingError(f"step {step}: {err}; stopped before the update, nothing was saved for "
                                f"this step (last checkpoint: {ckpt.latest()})") from None
        validated = val_loader is not None and _validates_at(step, total, tc.test_freq)
        if validated:
            val_history.append((step, trainer.validate(val_loader, step)))
            metrics.update(val_history[-1][1])
        metrics["training/global_step"], metrics["training/epoch"] = step, feed.epoch  # verl's
        rewards.append(metrics["critic/score/mean"])
        if "rollout/tool_calls/mean" in metrics:
            tool_calls.append(metrics["rollout/tool_calls/mean"])
        saver.poll()
        reason, at_the_end = stops.at_step_end(step, total, groups.device)  # at the end: nothing to resume, no requeue
        console = validated or step % tc.log_freq == 0 or step == total
        log = lambda: writer.log(metrics, step, CONSOLE_KEYS + tuple(_val_core(metrics)), console=console)  # noqa: E731
        if saves_at(step, total, tc.save_freq, reason):
            saving = time.perf_counter()
            trainer.hybrid.enter("checkpoint")  # offloaded optimizer state back on the device to be saved
            try:
                _save(saver, trainer, feed.resume_state(), step)
            except Exception:
                log()  # the step trained: its metrics stay on record whatever became of its save
                raise
            _count_save(metrics, time.perf_counter() - saving)
        log()
        if at_the_end:
            stops.ended_as_planned(step, at_the_end)
        _log_late(writer, trainer.late_metrics, profile_steps)
        if profile:
            print0(_profile_line(step, metrics))
            profile_steps.append(metrics)
        bar.update(1)
        if reason:
            saver.finalize()
            code = stops.stopped(step, reason, ckpt.latest())
            break
    saver.finalize()
    bar.close()
    if remote is not None:
        remote.stop()  # the rollout ranks' last spans come back with their goodbye
        trainer.late_metrics += trainer.shares.finish()
        _log_late(writer, trainer.late_metrics, profile_steps)
    if layout.critic_world_size:
        trainer.roles.critic.stop()
    if tc.timeline_dir:
        _write_timeline(trainer, tc.timeline_dir)
    _print_trend("mean reward", rewards)
    _print_trend("tool calls per trajectory", tool_calls)
    _print_val_trend(val_history)
    if profile and profile_steps:
        _print_profile_average(profile_steps)
    if tc.export_hf_dir and not code and not tc.val_only:
        _export_hf(trainer, tc.export_hf_dir)
    writer.close()
    stops.restore()
    return code


def _count_save(metrics: dict, seconds: float) -> None:
    """The step's checkpoint save inside its timing_s/step (and so perf/throughput), as verl's step timer holds
    _save_checkpoint; on its own as timing_s/save_checkpoint."""
    metrics["timing_s/save_checkpoint"] = seconds
    metrics["timing_s/step"] += seconds
    metrics.update(throughput_metrics(metrics, int(metrics["perf/total_num_tokens"]), dist.get_world_size()))


def _log_late(writer, late: list, profile_steps: list) -> None:
    """Log (and empty) `late`: [(step, metrics)] of steps logged already (split: perf/overlap, perf/idle/*)."""
    for step, metrics in late:
        writer.log(metrics, step, console=False)
        for logged in profile_steps:
            if logged.get("training/global_step") == step:
                logged.update(metrics)
    late.clear()


def _write_timeline(trainer, folder: str) -> None:
    """timeline.json under `folder`: every trainer rank's track, and in split placement the rollout ranks' and
    those of a critic of its own."""
    from hybridrl.timeline import overlap, role_groups, write_trace
    from hybridrl.trainer.split_perf import rollout_events

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, trainer.timeline.events())
    if dist.get_rank() != 0:
        return
    events = [e for part in parts for e in part]
    if trainer.remote is not None:
        events += rollout_events(trainer.remote.client.spans)
    events += rollout_events(getattr(trainer.roles.critic, "spans", []), "critic")
    path = os.path.join(folder, "timeline.json")
    write_trace(path, events)
    groups = {role: ranks for role, ranks in role_groups(events).items() if role in ("trainer", "rollout")}
    shared = f", trainer and rollout computing {overlap(events, groups):.0%} of the time" if len(groups) > 1 else ""
    print0(f"timeline: {path} (open it in Perfetto or chrome://tracing){shared}")


def _resume(trainer, path, loader) -> int:
    """Load the run's state from a published checkpoint folder (None: a fresh start); returns its step."""
    if path is None:
        return 0
    trainer.hybrid.enter("checkpoint")  # loaded in place: every trainable state on the device
    meta = load_checkpoint(path, _checkpointed_roles(trainer.roles), layout_of(trainer.groups))
    for name, role in _remote_roles(trainer.roles).items():
        if name not in meta["roles"]:
            from hybridrl.checkpoint import CheckpointError

            raise CheckpointError(f"{path} has no {name} state; resume with the algorithm.adv_estimator it was "
                                  "saved with, or trainer.resume_mode=disable")
        role.load(os.path.join(path, name))
    loader.load_state_dict(meta["data"])
    trainer.kl_ctrl.value = meta["kl_coef"]
    trainer.version = int(meta["step"])
    in_flight = os.path.join(path, IN_FLIGHT)
    if trainer.remote is not None and trainer.cfg.async_training.staleness_threshold and os.path.isfile(in_flight):
        with naming_damage(path, IN_FLIGHT, path=in_flight):
            batch = torch.load(in_flight, weights_only=False)
        trainer.remote.restore(batch)  # generated one version behind
    print0(f"resumed from {path} at step {meta['step']}")
    return int(meta["step"])


def _print_trend(name: str, values) -> None:
    """The demo's headline: the mean of a metric over the first and last 10% of this run's steps."""
    if len(values) < 2:
        return
    k = max(1, len(values) // 10)
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    ratio = f"{last / first:.1f}x" if first > 0 else "from 0" if first == 0 else f"{last - first:+.3g}"
    print0(f"{name}: first {k} steps {first:.3f} -> last {k} steps {last:.3f} ({ratio})")


def _print_val_trend(history) -> None:
    """Each headline validation value (verl's val-core) over the run: '<key>: 0 (step 0) -> ...'."""
    for key in _val_core(history[-1][1]) if len(history) > 1 else []:
        print0(f"{key}: " + " -> ".join(f"{m[key]:.3g} (step {step})" for step, m in history if key in m))


def _progress(total: int, start: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, desc="steps", file=sys.stderr, dynamic_ncols=True)


def _print_profile_average(steps) -> None:
    avg = {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in steps[0]}
    print0(_profile_line(0, avg).replace("[STEP 0]", f"[AVERAGE over {len(steps)} steps]"))


def _dry_run(trainer, loader, layout, cfg: Config) -> int:
    batches = endless(loader)
    prompts = next(batches)
    params = {n: p.detach().clone() for n, p in trainer.actor.engine.module.named_parameters()}
    metrics = trainer.train_step(prompts, step=1, update=False, next_prompts=lambda: next(batches))
    print0("dry run: one step of rollout, reward, log-probs, values, KL, advantages and losses (no update)")
    for key in sorted(metrics):
        print0(f"  {key}: {metrics[key]:.6g}")
    from hybridrl.planner.plan import plan

    print0(plan(cfg, layout.world_size, vocab_size=trainer.roles.spec.vocab_size).render())
    unchanged = all(torch.equal(p, params[n]) for n, p in trainer.actor.engine.module.named_parameters())
    if not unchanged:
        raise RuntimeError("dry run changed the actor's parameters")
    print0("Ready for real training")
    return 0


def _export_hf(trainer, folder: str) -> None:
    from hybridrl.models.hf_config import load_hf_config
    from hybridrl.models.lora_export import export_lora_model

    trainer.hybrid.enter("checkpoint")  # LoRA: the merged model, and the PEFT adapter in folder/adapter
    export_lora_model(trainer.actor.engine.module, trainer.roles.spec, trainer.groups, folder,
                      load_hf_config(trainer.roles.hf_folder), trainer.roles.hf_folder)
    print0(f"exported the actor to {folder}")
