"""Profile the slowest stage of the tiny demo step (configs/tiny_cpu.yaml) and say where its time goes.

1. A plain run (`scripts/train_ppo.py --profile`, no validation) gives timing_s/* per step from
   TensorBoard; the slowest stage is the largest median over steps 2..N.
2. A second run profiles only that stage (from its second call on) with cProfile (Python-level
   time, dispatch modes included) and torch.profiler (aten ops by self CPU time).

    .venv/bin/python benchmarks/profile_demo.py [--steps 8] [--stage NAME] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import benchlib as bl
from stage_profile import STAGES, StageProfile

OUT = os.path.join(bl.WORK, "profile_demo")


def overrides(tag: str, steps: int) -> list:
    return [f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.progress_bar=false", "trainer.resume_mode=disable", f"trainer.default_local_dir={OUT}/{tag}/ckpt",
            f"trainer.log_dir={OUT}/{tag}/tb", f"data.train_files=[{bl.WORK}/data/train.parquet]",
            f"data.val_files=[{bl.WORK}/data/test.parquet]"]


def _env() -> dict:
    from dist_helper import free_port

    return dict(os.environ, OMP_NUM_THREADS="2", MASTER_PORT=str(free_port()))


def plain_run(steps: int) -> dict:
    """{stage: median seconds over steps 2..N} of an unprofiled demo run."""
    from benchlib import read_scalars

    shutil.rmtree(os.path.join(OUT, "plain"), ignore_errors=True)  # stale event files would mix in
    cmd = [sys.executable, os.path.join(bl.ROOT, "scripts", "train_ppo.py"), "--config",
           os.path.join(bl.ROOT, "configs", "tiny_cpu.yaml"), "--profile"] + overrides("plain", steps)
    proc = subprocess.run(cmd, cwd=bl.ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    s = read_scalars(os.path.join(OUT, "plain", "tb"))
    timings = {k.split("/", 1)[1]: bl.median([v[i] for i in range(2, steps + 1)]) for k, v in s.items()
               if k.startswith("timing_s/")}
    profile_lines = [line for line in proc.stdout.splitlines() if line.startswith("[AVERAGE")]
    return {"timings": timings, "profile_line": profile_lines[-1] if profile_lines else ""}


def _child(stage: str, steps: int) -> None:
    """In the profiled subprocess: profile the stage over a demo run, print the result as JSON."""
    import torch

    from hybridrl.config.io import load_config
    from hybridrl.trainer.loop import main_loop

    torch.set_num_threads(2)
    profiled = StageProfile(stage)
    main_loop(load_config(os.path.join(bl.ROOT, "configs", "tiny_cpu.yaml"), overrides("profiled", steps)))
    print("@@JSON" + json.dumps(profiled.result()))


def profiled_run(stage: str, steps: int) -> dict:
    shutil.rmtree(os.path.join(OUT, "profiled"), ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", stage, "--steps", str(steps)]
    proc = subprocess.run(cmd, cwd=bl.ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("@@JSON"))[6:])


def report(plain: dict, stage: str, prof: dict, steps: int, samples: list) -> str:
    t = plain["timings"]
    rows = [[k, f"{v * 1000:.1f}", f"{100 * v / t['step']:.0f}%"] + bl.stamp(samples)
            for k, v in sorted(t.items(), key=lambda kv: -kv[1])]
    return (f"## Profile of the tiny demo step (configs/tiny_cpu.yaml)\n\n"
            f"Median ms per stage over steps 2..{steps} of an unprofiled run (timing_s/* from TensorBoard); "
            f"`--profile` average: `{plain['profile_line']}`\n\n"
            + bl.table(["stage", "ms", "share of step"] + bl.STAMP_HEADER, rows)
            + f"\n\nSlowest stage: **{stage}**. cProfile of it over {prof['calls']} calls (top by tottime):\n\n"
            f"```\n{prof['cprofile']}\n```\n\ntorch.profiler, one call, aten ops by self CPU time:\n\n"
            f"```\n{prof['ops']}\n```")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stage", default="", help="profile this stage instead of the slowest")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.child:
        return _child(args.child, args.steps)
    samples = [bl.sample()]
    plain = plain_run(args.steps)
    samples.append(bl.sample())
    stage = args.stage or max((k for k in plain["timings"] if k in STAGES), key=plain["timings"].get)
    text = report(plain, stage, profiled_run(stage, args.steps), args.steps, samples)
    print(text)
    if not args.no_write:
        bl.write_section("profile", text)


if __name__ == "__main__":
    main()
