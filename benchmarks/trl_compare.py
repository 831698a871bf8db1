"""What bench_grpo_vs_trl.py and bench_ppo_vs_trl.py share: running both sides, reading their step
times, the report tables, and the matmul-only (FLOP-bound) time of the training passes.

hybridrl runs in the interpreter that runs the benchmark (`hybridrl_side.py`, this checkout's src/
first on the path, timing_s/* read back from TensorBoard); TRL runs in a side environment given
by --trl-python. The first step of every run is warm-up and is skipped.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import benchlib as bl


def env() -> dict:
    from dist_helper import free_port

    path = os.pathsep.join([os.path.join(bl.ROOT, "src"), os.path.join(bl.ROOT, "benchmarks")])
    return dict(os.environ, OMP_NUM_THREADS="2", MASTER_PORT=str(free_port()), PYTHONPATH=path)


def common_overrides(run_dir: str, steps: int) -> list:
    w = bl.WORK
    return [f"model.path={bl.bench_model_folder()}", f"data.tokenizer={bl.bench_tokenizer_folder()}",
            f"data.train_files=[{w}/data/train.parquet]", f"data.val_files=[{w}/data/test.parquet]",
            f"reward.custom_function.path={bl.ROOT}/benchmarks/trivial_reward.py",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.progress_bar=false", "trainer.logger=[tensorboard]", "trainer.save_freq=0",
            "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}/ckpt", f"trainer.log_dir={run_dir}/tb"]


def _hybridrl_process(run_dir: str, steps: int, overrides: list, extra_env=None, nproc: int = 1) -> str:
    """Runs hybridrl_side.py once in a fresh run_dir (under torchrun when nproc > 1); returns its stdout."""
    shutil.rmtree(run_dir, ignore_errors=True)
    e = dict(env(), **(extra_env or {}))
    cmd = [sys.executable] + (["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                               f"--master_port={e['MASTER_PORT']}"] if nproc > 1 else [])
    cmd.append(os.path.join(bl.ROOT, "benchmarks", "hybridrl_side.py"))
    proc = subprocess.run(cmd + common_overrides(run_dir, steps) + overrides, cwd=bl.ROOT,
                          env=e, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"hybridrl side failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def run_hybridrl(run_dir: str, steps: int, overrides: list, stages, extra_env=None, nproc: int = 1) -> dict:
    """Steps 2..steps of one run: timing_s/step, and wall_s, the wall clock between the TensorBoard
    events of consecutive steps (everything the loop does, data and logging included)."""
    _hybridrl_process(run_dir, steps, overrides, extra_env, nproc)
    s, wall = bl.read_scalars(os.path.join(run_dir, "tb"), with_wall_time=True)
    keep = range(2, steps + 1)
    logged = wall["training/global_step"]
    return {"step_s": [s["timing_s/step"][i] for i in keep], "completion_len": [s["response_length/mean"][i] for i in keep],
            "wall_s": [logged[i] - logged[i - 1] for i in keep], "logged_at": [logged[i] for i in range(1, steps + 1)],
            "stages": {k: [s[f"timing_s/{k}"][i] for i in keep] for k in stages if f"timing_s/{k}" in s}}


def profile_hybridrl(name: str, steps: int, overrides: list, stage: str) -> dict:
    """One more (untimed) hybridrl run with `stage` profiled (stage_profile.StageProfile)."""
    out = _hybridrl_process(os.path.join(bl.WORK, f"{name}_hybridrl_profiled"), max(steps, 4), overrides,
                            {"BENCH_PROFILE_STAGE": stage})
    return json.loads(next(line for line in out.splitlines() if line.startswith("@@JSON"))[6:])


def profile_text(prof: dict, stage: str) -> str:
    return (f"<details><summary>Profile of hybridrl's {stage}</summary>\n\n"
            f"cProfile over {prof['calls']} calls (top by tottime):\n\n```\n{prof['cprofile']}\n```\n\n"
            f"torch.profiler, one call, aten ops by self CPU time:\n\n```\n{prof['ops']}\n```\n\n</details>")


def prompts_json() -> str:
    """The hybridrl side's synthetic arith prompts, as TRL's plain-text prompts (the same tokens)."""
    from hybridrl.data.synthetic import arith_rows

    os.makedirs(bl.WORK, exist_ok=True)
    path = os.path.join(bl.WORK, "trl_prompts.json")
    with open(path, "w") as f:
        json.dump([r["prompt"][0]["content"] for r in arith_rows(2000, 1, "train")], f)
    return path


def run_trl(trl_python: str, script: str, args: list, stage_names: dict) -> dict:
    """The TRL side prints one JSON line last: step_s, completion_len and one list per stage key."""
    cmd = [trl_python, os.path.join(bl.ROOT, "benchmarks", script)] + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=bl.ROOT, env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"TRL side failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"step_s": out["step_s"][1:], "completion_len": out["completion_len"][1:],
            "stages": {label: out[key][1:] for key, label in stage_names.items()}}


def trl_versions(trl_python: str) -> str:
    code = "import trl, accelerate, transformers; print(trl.__version__, accelerate.__version__, transformers.__version__)"
    trl, acc, tf = subprocess.run([trl_python, "-c", code], capture_output=True, text=True).stdout.split()
    return f"TRL {trl}, accelerate {acc}, transformers {tf} (in {os.path.dirname(os.path.dirname(trl_python))})"


def check_trl_python(trl_python: str, version: str) -> None:
    if not os.path.exists(trl_python):
        raise SystemExit(f"no TRL environment at {trl_python}: python3 -m venv <dir> && <dir>/bin/pip install "
                         f"torch==2.13.0 -r requirements.txt -r requirements-bench.txt trl=={version}, "
                         "then pass --trl-python <dir>/bin/python")


@dataclass(frozen=True)
class Comparison:
    """What one benchmark against TRL runs; `passes(stage medians of hybridrl) -> {side: [pass]}`
    lists the training passes of each side for the matmul-only bound (see bound_table)."""
    name: str  # RESULTS.md section and prefix of the run folders under outputs/bench
    title: str
    setup: str  # one step's work, for the report
    trl_version: str
    trl_venv: str  # default side environment, relative to the checkout
    trl_script: str
    trl_stages: dict  # key printed by trl_script -> stage label
    trl_rollout_stage: str  # the label whose time is the TRL step's rollout part
    stages: tuple  # timing_s/* keys of the hybridrl side
    overrides: tuple
    lr: float
    profiled: str  # the hybridrl stage whose profile is attached
    passes: Callable
    notes: dict = field(default_factory=dict)  # extra sentences: "lengths", "bound"


def parse_args(doc: str, trl_python: str):
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--trl-python", default=trl_python, help="python of the side environment with TRL")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args()


def alternate(c: Comparison, args) -> list:
    """args.rounds rounds of (hybridrl run, TRL run), args.steps steps each, on the same prompts."""
    prompts, runs = prompts_json(), []
    for i in range(args.rounds):
        hyb = run_hybridrl(os.path.join(bl.WORK, f"{c.name}_hybridrl_{i}"), args.steps, list(c.overrides), c.stages)
        trl_args = [bl.bench_model_folder(), bl.bench_tokenizer_folder(), prompts,
                    os.path.join(bl.WORK, f"{c.name}_trl_{i}"), args.steps, c.lr]
        runs.append({"hybridrl": hyb, "trl": run_trl(args.trl_python, c.trl_script, trl_args, c.trl_stages)})
        print(f"round {i + 1}: hybridrl {hyb['step_s']} TRL {runs[-1]['trl']['step_s']}", flush=True)
    return runs


def main(c: Comparison, doc: str) -> None:
    args = parse_args(doc, os.path.join(bl.ROOT, c.trl_venv, "bin", "python"))
    check_trl_python(args.trl_python, c.trl_version)
    runs = alternate(c, args)
    prof = profile_hybridrl(c.name, args.steps, list(c.overrides), c.profiled)
    text = report(c, runs, args, prof)
    print(text)
    if not args.no_write:
        bl.write_section(c.name, text)


# ---- report ------------------------------------------------------------------------------------

def pooled(runs: list, side: str) -> float:
    return bl.median([t for r in runs for t in r[side]["step_s"]])


def round_table(runs: list) -> str:
    rows = [[i + 1, f"{bl.median(r['hybridrl']['step_s']):.3f}", f"{bl.median(r['trl']['step_s']):.3f}",
             f"{bl.median(r['hybridrl']['step_s']) / bl.median(r['trl']['step_s']):.2f}x"] for i, r in enumerate(runs)]
    h, t = pooled(runs, "hybridrl"), pooled(runs, "trl")
    rows.append(["all", f"**{h:.3f}**", f"**{t:.3f}**", f"**{h / t:.2f}x**"])
    return bl.table(["round", "hybridrl s/step", "TRL s/step", "hybridrl / TRL"], rows)


def stage_medians(runs: list, side: str) -> dict:
    return {k: bl.median([x for r in runs for x in r[side]["stages"][k]]) for k in runs[0][side]["stages"]}


def training_part(runs: list, side: str, outside: tuple) -> float:
    """Median over steps of the step's time minus its `outside` stages, step by step (a difference
    of medians would carry the noise of each stage into it)."""
    rest = []
    for r in runs:
        stages = [r[side]["stages"][k] for k in outside if k in r[side]["stages"]]
        rest += [step - sum(parts) for step, *parts in zip(r[side]["step_s"], *stages)]
    return bl.median(rest)


def stage_table(runs: list) -> str:
    rows = []
    for side, label in (("hybridrl", "hybridrl"), ("trl", "TRL")):
        total = pooled(runs, side)
        for k, v in stage_medians(runs, side).items():
            rows.append([label, k, f"{v:.3f}", f"{100 * v / total:.0f}%"])
    return bl.table(["side", "stage", "s", "share of step"], rows)


def verdict(runs: list, target: float = 0.5) -> tuple:
    ratio = pooled(runs, "hybridrl") / pooled(runs, "trl")
    return ratio, ("met" if ratio <= target else f"missed: {ratio / target:.1f}x off the target")


def report(c: Comparison, runs: list, args, prof: dict) -> str:
    ratio, verdict_text = verdict(runs)
    h = stage_medians(runs, "hybridrl")
    training = {"hybridrl": training_part(runs, "hybridrl", ("gen", "update_weights")),
                "TRL": training_part(runs, "trl", (c.trl_rollout_stage,))}
    return (f"## {c.title}\n\nMedian seconds per step (steps 2..{args.steps} of each run; {args.rounds} rounds, "
            f"hybridrl A then TRL B), {c.setup}, fp32, 2 threads, AdamW lr {c.lr:g}.\n\n" + round_table(runs)
            + f"\n\nTarget hybridrl <= 0.5x TRL: **{ratio:.2f}x** ({verdict_text}). Mean response lengths seen: "
            f"{lengths(runs)}{c.notes.get('lengths', '')}.\n\nStage medians (hybridrl: timing_s/*; TRL: the methods "
            f"named timed inside its trainer, the rest of its step is its training part):\n\n" + stage_table(runs)
            + f"\n\nTraining part (median over steps of hybridrl: step - gen - update_weights; TRL: step - "
            f"{c.trl_rollout_stage}) against "
            f"the matmul-only time of the same passes over the same tokens on this machine{c.notes.get('bound', '')}:"
            f"\n\n" + bound_table(c.passes(h), training) + "\n\n" + profile_text(prof, c.profiled)
            + f"\n\nPeer: {trl_versions(args.trl_python)}.")


def lengths(runs: list) -> str:
    seen = {side: sorted({round(x, 2) for r in runs for x in r[side]["completion_len"]}) for side in ("hybridrl", "trl")}
    return f"hybridrl {seen['hybridrl']}, TRL {seen['trl']}"


# ---- FLOP-bound time ---------------------------------------------------------------------------

def _gemm_s(m: int, k: int, n: int, reps: int = 9) -> float:
    """Median seconds of one [m, k] @ [k, n] fp32 matmul on this machine (2 threads)."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return bl.median(times)


@functools.lru_cache(maxsize=None)  # one figure per pass shape, the same for both sides
def matmul_seconds(sequences: int, seq_len: int, lm_head: bool = True, backward: bool = False) -> float:
    """The matmuls of one forward (with backward: x3, data and weight gradients timed as their own
    shapes) of the bench model over sequences x seq_len tokens: projections, attention scores and
    values per head, and the LM head (or the critic's [H, 1] value head). No other op is counted."""
    import torch

    torch.set_num_threads(2)
    m = bl.BENCH_MODEL
    h, heads, kv, inter = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"], m["intermediate_size"]
    d, tokens = h // heads, sequences * seq_len
    linears = [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * inter), (inter, h)] * m["num_hidden_layers"]
    linears.append((h, m["vocab_size"] if lm_head else 1))
    total = 0.0
    for k, n in linears:
        total += _gemm_s(tokens, k, n)
        if backward:
            total += _gemm_s(tokens, n, k) + _gemm_s(k, tokens, n)  # dX = dY W^T, dW = X^T dY
    per_layer_attention = sequences * heads * (_gemm_s(seq_len, d, seq_len) + _gemm_s(seq_len, seq_len, d))
    total += per_layer_attention * m["num_hidden_layers"] * (3 if backward else 1)
    return total


def bound_table(passes: dict, measured: dict) -> str:
    """passes: side -> [(label, sequences, seq_len, lm_head, backward)]; measured: side -> training s."""
    rows = []
    for side, items in passes.items():
        bound = sum(matmul_seconds(s, t, head, bwd) for _, s, t, head, bwd in items)
        names = " + ".join(label for label, *_ in items)
        rows.append([side, names, f"{measured[side]:.3f}", f"{bound:.3f}", f"{measured[side] / bound:.1f}x"])
    return bl.table(["side", "training passes (matmuls timed)", "measured s", "matmul-only s", "measured / bound"], rows)
