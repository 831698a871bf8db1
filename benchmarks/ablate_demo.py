"""A/B of the two changes proposed for the tiny demo's slowest stages (old_log_prob, update_actor).

Variants, timed in alternation on the same trainer, batch and weights (one gloo process):
  base      as the code runs today
  no-mode   without hybridrl's CudaToCpuMode around megatron's schedule; its only explicit CUDA
            tensor there (`total_num_tokens = torch.zeros(..., device="cuda")`) is made on CPU by a
            narrow patch of the schedules module instead (what the proposal does in cpu_compat)
  micro64   one micro-batch of the whole 64-sample batch for log-probs and the update (tiny_cpu.yaml had
            micro-batches of 8 and 16 when this was proposed; measured then at 0.28x log-prob and 0.52x
            update time, it was adopted: the config now runs one micro-batch per pass, so micro64 = base)
  both      no-mode + micro64
Timing is the calling thread's CPU time (1 intra-op thread), which the other processes on a shared
2-core machine disturb much less than wall time; medians over the repetitions.

    .venv/bin/python benchmarks/ablate_demo.py [--reps 20] [--no-write]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
import types

import benchlib as bl
from profile_demo import overrides

VARIANTS = ("base", "no-mode", "micro64", "both")


def _schedule_patch():
    """(enter, leave) toggles for the no-mode variant."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    import hybridrl.models.forward as forward

    proxy = types.ModuleType("torch_with_cpu_zeros")
    proxy.__dict__.update(torch.__dict__)
    proxy.zeros = lambda *a, device=None, **k: torch.zeros(*a, device="cpu" if device == "cuda" else device, **k)
    saved = (forward.cuda_to_cpu, schedules.torch)

    def set_mode(on: bool):
        forward.cuda_to_cpu, schedules.torch = saved if on else (contextlib.nullcontext, proxy)
    return set_mode


def body(reps: int) -> dict:
    import torch

    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.loop import setup_run
    from hybridrl.config.batching import MicroBatching

    torch.set_num_threads(1)
    cfg = load_config(os.path.join(bl.ROOT, "configs", "tiny_cpu.yaml"), overrides("ablate", 10))
    _, tok, layout, groups, loader, _ = setup_run(cfg)
    trainer = PPOTrainer(cfg, layout, groups, tok, build_roles(cfg, groups, tok, 10), RewardManager(cfg.reward), None)
    trainer.sync_rollout_weights()
    prompts = next(iter(loader))
    trainer.train_step(prompts, 1)  # Adam states exist from here on
    batch = trainer.generate(prompts, trainer.train_sampling(), 2)
    actor, base_cfg, set_mode = trainer.actor, trainer.actor.cfg, _schedule_patch()
    batch["old_log_probs"], _ = actor.compute_log_prob(batch, MicroBatching(base_cfg.log_prob_micro_batch_size_per_gpu))
    trainer.compute_advantages(batch, trainer.score(batch, prompts, cfg.rollout.n))
    rows = layout.actor_mini_batch_samples
    times = {}
    for _ in range(reps):
        for v in VARIANTS:
            set_mode(v in ("base", "micro64"))
            big = v in ("micro64", "both")
            start = time.thread_time()
            actor.compute_log_prob(batch, MicroBatching(rows if big else base_cfg.log_prob_micro_batch_size_per_gpu),
                                   with_entropy=True)
            mid = time.thread_time()
            actor.update_policy(batch, rows, MicroBatching(rows if big else base_cfg.ppo_micro_batch_size_per_gpu))
            times.setdefault(("old_log_prob", v), []).append(mid - start)
            times.setdefault(("update_actor", v), []).append(time.thread_time() - mid)
    set_mode(True)
    return {k: bl.median(v) for k, v in times.items()}


def report(t: dict, reps: int, samples: list) -> str:
    rows = []
    for stage in ("old_log_prob", "update_actor"):
        base = t[(stage, "base")]
        rows.append([stage] + [f"{t[(stage, v)] * 1000:.1f} ({t[(stage, v)] / base:.2f}x)" for v in VARIANTS]
                    + bl.stamp(samples))
    return ("## Ablation of the proposed demo speed-ups\n\n"
            f"CPU ms of the calling thread (1 thread), median of {reps} alternating repetitions, tiny_cpu.yaml "
            "batch (64 samples), ratio to base in brackets. base is the code and config as they are; micro64 "
            "(one micro-batch per pass) was adopted after it measured 0.28x log-prob and 0.52x update time "
            "against the config's micro-batches of 8/16 (2026-12-02), so it now equals base; no-mode (megatron's "
            "schedule without CudaToCpuMode) was not adopted:\n\n" + bl.table(["stage"] + list(VARIANTS) + bl.STAMP_HEADER, rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    from dist_helper import run_distributed

    samples = [bl.sample()]
    times = run_distributed(body, 1, args.reps, timeout=900)[0]
    text = report(times, args.reps, samples + [bl.sample()])
    print(text)
    if not args.no_write:
        bl.write_section("ablation", text)


if __name__ == "__main__":
    main()
