"""Measure a real trainer's per-phase memory on CPU by counting the bytes a GPU would hold.

`PhaseMeter(trainer)` wraps the rollout's `generate`, the actor's `compute_log_prob` and
`update_policy`, and the trainer's `sync_rollout_weights`. For each phase it records the resident
bytes (unique storages of actor params, grads and optimizer states, and engine weights; offloaded
storages are resized to 0 and count nothing) before and after, plus the peak of new allocations
inside it (`reshard.LiveTensorMeter`: KV cache, activations, logits, buckets). Used by
bench_memory.py inside a gloo process; it changes no training result.

A CPU-path bug of hybridrl is worked around here (see RESULTS.md, "Bugs found"):
`rollout.base.weight_checksum` calls `.numpy()` on CPU tensors, which marks the training
parameters' storages non-resizable, so the offload after the first weight sync fails;
`run_steps` hashes through a byte copy instead (same digests).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib

from hybridrl.offload import grad_tensors, optimizer_tensors, param_tensors
from hybridrl.reshard import LiveTensorMeter


def resident(trainer) -> dict:
    """{"actor/weights"|"actor/grads"|"actor/optimizer"|"rollout/weights": bytes}, storages counted once."""
    actor = trainer.actor
    groups = (("actor/weights", param_tensors(actor.engine.module)), ("actor/grads", grad_tensors(actor.engine.module)),
              ("actor/optimizer", optimizer_tensors(actor.optimizer)),
              ("rollout/weights", list(trainer.rollout.params.values())))
    seen, out = set(), {}
    for name, tensors in groups:
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            total += s.nbytes()
        out[name] = total
    return out


class PhaseMeter:
    """Per-phase {"resident": {...}, "transient": bytes, "total": bytes}, for the last step run."""

    def __init__(self, trainer):
        self.trainer, self.phases = trainer, {}
        rollout, actor = trainer.rollout, trainer.actor
        rollout.generate = self._wrap("rollout", rollout.generate)
        actor.compute_log_prob = self._wrap("old_log_prob", actor.compute_log_prob)
        actor.update_policy = self._wrap("update_actor", actor.update_policy)
        trainer.sync_rollout_weights = self._wrap("update_weights", trainer.sync_rollout_weights)

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def measured(*args, **kwargs):
            before = resident(self.trainer)
            with LiveTensorMeter() as meter:
                out = fn(*args, **kwargs)
            after = resident(self.trainer)
            held = max((before, after), key=lambda r: sum(r.values()))
            self.phases[name] = {"resident": held, "transient": meter.peak,
                                 "total": sum(held.values()) + meter.peak}
            return out
        return measured

    @property
    def peak(self) -> tuple:
        name = max(self.phases, key=lambda n: self.phases[n]["total"])
        return name, self.phases[name]["total"]


def _checksum_without_numpy(t) -> str:
    """rollout.base.weight_checksum's digest, read through ctypes instead of .numpy()."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().contiguous().reshape(-1).cpu()
    h.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))
    return h.hexdigest()


def _work_around_cpu_bug() -> None:
    import hybridrl.reshard
    import hybridrl.rollout.native

    hybridrl.reshard.weight_checksum = hybridrl.rollout.native.weight_checksum = _checksum_without_numpy


def run_steps(config_path: str, overrides: list, offload: bool, steps: int = 2) -> dict:
    """Build the roles and trainer of a config (world 1), run `steps` steps, meter the last one.

    offload: the hybrid engine as on a GPU (actor state offloaded during rollout, engine weights
    moved off the device while asleep); otherwise everything stays resident (two-copy layout).
    """
    from hybridrl.config_io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.roles import build_roles
    from hybridrl.trainer import PPOTrainer
    from hybridrl.trainer_loop import _setup

    flags = "true" if offload else "false"
    cfg = load_config(config_path, overrides + [f"actor.offload.{k}={flags}" for k in ("params", "grads", "optimizer")]
                      + [f"rollout.free_cache_engine={flags}"])
    _, tokenizer, layout, groups, loader, _ = _setup(cfg)
    roles = build_roles(cfg, groups, tokenizer, steps)
    trainer = PPOTrainer(cfg, layout, groups, tokenizer, roles, RewardManager(cfg.reward), writer=None)
    trainer.rollout.offload_weights_on_sleep = offload  # what NativeEngine does by default on a GPU
    _work_around_cpu_bug()
    trainer.sync_rollout_weights()
    meter = PhaseMeter(trainer)
    batches = iter(loader)
    for step in range(1, steps + 1):  # Adam states exist from the first update on: meter the last step
        trainer.train_step(next(batches), step)
    return meter.phases
