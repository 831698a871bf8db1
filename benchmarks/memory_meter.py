"""Measure a real trainer's per-phase memory on CPU by counting the bytes a GPU would hold.

`PhaseMeter(trainer)` wraps the call each phase of a step runs in (the rollout's `generate`, the
actor's `compute_log_prob` and `update_policy`, and `reshard.update_engine_weights`), after the
trainer has moved state for that phase (`PPOTrainer.hybrid`). For each phase it records the
resident bytes when the call returns (unique storages of the actor's params, grads and optimizer
states and the engine's weights; offloaded storages are resized to 0 and count nothing), plus the
peak of new allocations inside the call (`reshard.LiveTensorMeter`: KV cache, activations, logits,
buckets). Used by bench_memory.py inside a gloo process; it changes no training result.
"""
from __future__ import annotations

import functools

import hybridrl.placement.reshard
from hybridrl.planner.plan import STATE_KINDS
from hybridrl.placement.reshard import LiveTensorMeter

PHASES = {"rollout": "generate", "actor log-prob": "compute_log_prob", "actor update": "update_policy",
          "weight sync": "update_engine_weights"}
"""planner phase -> the call measured for it (GRPO: no critic, no reference)."""


def resident(trainer) -> dict:
    """{"actor/weights"|"actor/grads"|"actor/optimizer"|"rollout/engine_weights": bytes on the device}."""
    out = {f"actor/{STATE_KINDS[part]}": n for part, n in trainer.hybrid.offloaders["actor"].device_bytes().items()}
    out["rollout/engine_weights"] = trainer.rollout.own_weight_bytes()  # 0 where it reads the actor's
    return out


class PhaseMeter:
    """Per-phase {"resident": {...}, "transient": bytes, "total": bytes}, for the last step run."""

    def __init__(self, trainer):
        self.trainer, self.phases = trainer, {}
        owners = {"generate": trainer.rollout, "compute_log_prob": trainer.actor, "update_policy": trainer.actor,
                  "update_engine_weights": hybridrl.placement.reshard}  # sync_rollout_weights imports it at each call
        for phase, method in PHASES.items():
            setattr(owners[method], method, self._wrap(phase, getattr(owners[method], method)))

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def measured(*args, **kwargs):
            with LiveTensorMeter() as meter:
                out = fn(*args, **kwargs)
            held = resident(self.trainer)
            self.phases[name] = {"resident": held, "transient": meter.peak, "total": sum(held.values()) + meter.peak}
            return out
        return measured


def run_steps(config_path: str, overrides: list, offload: bool, steps: int = 2, share: bool = True) -> dict:
    """Build the roles and trainer of a config (world 1), run `steps` steps, meter the last one.

    offload: the hybrid engine as on a GPU (actor state offloaded while idle, engine weights moved
    off the device while asleep); otherwise everything stays resident (two-copy layout). share:
    rollout.share_weights (the engine reads the actor's weights where the layouts allow). Returns
    {"phases": PhaseMeter.phases, "prompt_width": the padded prompt length of the last batch}.
    """
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.loop import setup_run

    flags = "true" if offload else "false"
    cfg = load_config(config_path, overrides + [f"actor.offload.{k}={flags}" for k in ("params", "grads", "optimizer")]
                      + [f"rollout.free_cache_engine={flags}", f"rollout.share_weights={str(share).lower()}"])
    _, tokenizer, layout, groups, loader, _ = setup_run(cfg)
    roles = build_roles(cfg, groups, tokenizer, steps)
    trainer = PPOTrainer(cfg, layout, groups, tokenizer, roles, RewardManager(cfg.reward), writer=None)
    trainer.rollout.offload_weights_on_sleep = offload  # what NativeEngine does by default on a GPU
    trainer.sync_rollout_weights()
    meter = PhaseMeter(trainer)
    batches = iter(loader)
    for step in range(1, steps + 1):  # Adam states exist from the first update on: meter the last step
        prompts = next(batches)
        trainer.train_step(prompts, step)
    return {"phases": meter.phases, "prompt_width": prompts.input_ids.shape[1]}
