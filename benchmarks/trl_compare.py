"""What bench_grpo_vs_trl.py and bench_ppo_vs_trl.py share: running both sides, reading their step
times, the report tables, and the matmul-only (FLOP-bound) time of the training passes.

hybridrl runs in the interpreter that runs the benchmark (`hybridrl_side.py`, this checkout's src/
first on the path, timing_s/* read back from TensorBoard); TRL runs in a side environment given
by --trl-python. Both sides are timed over the same window: wall clock from the end of one step to
the end of the next (hybridrl: the TensorBoard events of consecutive steps; TRL: `on_step_end`), so
data fetch, logging and garbage collection count on both sides. Garbage collection (every collection,
automatic or `gc.collect()`, through `gc.callbacks`) is shown as its own stage on both sides. The
first step of every run is warm-up and is skipped.
"""
from __future__ import annotations

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


def gc_per_window(events: list, ends: list) -> list:
    """Seconds of garbage collection (events: [(start, seconds)], time.time()) in each window
    (ends[i - 1], ends[i]] of consecutive step ends."""
    return [sum(sec for start, sec in events if a < start <= b) for a, b in zip(ends, ends[1:])]


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
    """Steps 2..steps of one run: timing_s/step (the trainer's own step timer), wall_s, the wall clock
    between the TensorBoard events of consecutive steps (everything the loop does, data fetch and
    logging included), gc_s (garbage collection in that window) and the timing_s/* stages."""
    out = _hybridrl_process(run_dir, steps, overrides, extra_env, nproc)
    s, wall = bl.read_scalars(os.path.join(run_dir, "tb"), with_wall_time=True)
    keep = range(2, steps + 1)
    logged = wall["training/global_step"]
    gc_events = [e for line in out.splitlines() if line.startswith("@@GC") for e in json.loads(line[4:])]
    return {"step_s": [s["timing_s/step"][i] for i in keep], "completion_len": [s["response_length/mean"][i] for i in keep],
            "wall_s": [logged[i] - logged[i - 1] for i in keep], "logged_at": [logged[i] for i in range(1, steps + 1)],
            "gc_s": gc_per_window(gc_events, [logged[i] for i in range(1, steps + 1)]),
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
    """The TRL side prints one JSON line last: wall_s (step end to step end), gc_s, completion_len and
    one list per stage key; steps 2.. are kept. step_s is wall_s, the window hybridrl is timed over."""
    cmd = [trl_python, os.path.join(bl.ROOT, "benchmarks", script)] + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=bl.ROOT, env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"TRL side failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"step_s": out["wall_s"][1:], "wall_s": out["wall_s"][1:], "gc_s": out["gc_s"][1:],
            "completion_len": out["completion_len"][1:],
            "stages": {label: out[key][1:] for key, label in stage_names.items()}}


def trl_versions(trl_python: str) -> str:
    code = "import trl, accelerate, transformers; print(trl.__version__, accelerate.__version__, transformers.__version__)"
    trl, acc, tf = subprocess.run([trl_python, "-c", code], capture_output=True, text=True).stdout.split()
    where = os.path.relpath(os.path.dirname(os.path.dirname(trl_python)), bl.ROOT)
    return f"TRL {trl}, accelerate {acc}, transformers {tf} (in {bl.public_path(where)})"


def check_trl_python(trl_python: str, version: str) -> None:
    if not os.path.exists(trl_python):
        raise SystemExit(f"no TRL environment at {trl_python}: python3 -m venv <dir> && <dir>/bin/pip install "
                         f"torch==2.13.0 -r requirements.txt -r requirements-bench.txt trl=={version}, "
                         "then pass --trl-python <dir>/bin/python")


@dataclass(frozen=True)
class Pass:
    """One training pass for the matmul-only bound: `times` x (forward, with backward: and its
    gradients) of the bench model over rows x seq_len tokens, the head over rows x head_len of them."""
    label: str
    rows: int
    seq_len: int
    head_len: int  # positions per row the head runs over: the response (the loss and values need no more)
    lm_head: bool  # the vocabulary head, else the critic's [H, 1] value head
    backward: bool
    times: int = 1

    def shape(self) -> tuple:
        return self.rows, self.seq_len, self.head_len, self.lm_head, self.backward


@dataclass(frozen=True)
class Comparison:
    """What one benchmark against TRL runs; `passes(side label, its stage medians) -> [Pass]` lists the
    training passes of a side (a hybridrl variant or a TRL side) for the matmul-only bound (bound_table)."""
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
    variants: tuple = ()
    """(label, overrides[, TRL side label]) of each hybridrl side, compared with that TRL side ("TRL" when
    not named); empty: one side, "hybridrl", `overrides`."""
    trl_sides: tuple = (("TRL", ()),)  # (label, extra arguments of trl_script) of each TRL side
    rounds: int = 3  # default of --rounds

    def sides(self) -> list:
        """(label, overrides) of the hybridrl sides; the first is the one profiled."""
        return [tuple(v[:2]) for v in self.variants] or [("hybridrl", self.overrides)]

    def peer(self, side: str) -> str:
        """The TRL side a hybridrl side is compared with."""
        return next((v[2] for v in self.variants if v[0] == side and len(v) > 2), "TRL")


def parse_args(doc: str, trl_python: str, rounds: int = 3):
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--trl-python", default=trl_python, help="python of the side environment with TRL")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--max-wait", type=float, default=180,
                   help="seconds each run waits at most for the 1-minute load to fall below 2.5")
    p.add_argument("--rerun-load", type=float, default=RERUN_LOAD,
                   help="a run whose 1-minute load at its end exceeds this runs again, once")
    return p.parse_args()


RERUN_LOAD = 4.0  # 1-minute load at a run's end above which the run is repeated (2 cores: ours is ~2)


def alternate(c: Comparison, args) -> list:
    """args.rounds rounds of one run per side (each hybridrl variant, then TRL; the order rotates by one
    each round), args.steps steps each, on the same prompts. Per run: its steps and (time, load) samples."""
    prompts, runs = prompts_json(), []
    sides = [label for label, _ in c.sides()] + [label for label, _ in c.trl_sides]
    overrides, trl_extra = dict(c.sides()), dict(c.trl_sides)
    for i in range(args.rounds):
        rnd = {}
        for side in sides[i % len(sides):] + sides[:i % len(sides)]:
            for attempt in range(2):  # a run that other work disturbed (load > RERUN_LOAD at its end) runs again, once
                bl.wait_quiet(max_s=args.max_wait)  # other work: wait a little for it (the stamp shows what was left)
                at = bl.sample()
                if side in trl_extra:
                    trl_args = [bl.bench_model_folder(), bl.bench_tokenizer_folder(), prompts,
                                os.path.join(bl.WORK, f"{c.name}_{side.replace(' ', '_')}_{i}"), args.steps, c.lr,
                                *trl_extra[side]]
                    rnd[side] = run_trl(args.trl_python, c.trl_script, trl_args, c.trl_stages)
                else:
                    run_dir = os.path.join(bl.WORK, f"{c.name}_{side.replace(' ', '_')}_{i}")
                    rnd[side] = run_hybridrl(run_dir, args.steps, list(overrides[side]), c.stages)
                rnd[side]["samples"] = [at, bl.sample()]
                rnd[side]["attempts"] = attempt + 1
                if rnd[side]["samples"][-1][1] <= args.rerun_load:
                    break
        shared_bound(c, rnd)
        runs.append(rnd)
        print(f"round {i + 1}: " + ", ".join(f"{k} {bl.median(v['step_s']):.3f}" for k, v in rnd.items()), flush=True)
    return runs


def shared_bound(c: Comparison, rnd: dict) -> None:
    """bound_s of every side of a round: each distinct pass shape timed once, after the round's runs, and
    shared by every side that ran it (two sides never differ by the noise of timing the same matmuls)."""
    ran = {side: c.passes(side, {k: 0 for k in run["stages"]}) for side, run in rnd.items()}
    seconds = {}
    for p in (p for passes in ran.values() for p in passes):
        if p.shape() not in seconds:
            seconds[p.shape()] = matmul_seconds(p)
    for side, passes in ran.items():
        rnd[side]["bound_s"] = sum(p.times * seconds[p.shape()] for p in passes)


def main(c: Comparison, doc: str) -> None:
    args = parse_args(doc, os.path.join(bl.ROOT, c.trl_venv, "bin", "python"), c.rounds)
    check_trl_python(args.trl_python, c.trl_version)
    runs = alternate(c, args)
    prof = profile_hybridrl(c.name, args.steps, list(c.sides()[0][1]), c.profiled)
    text, summary = report(c, runs, args, prof)
    print(text)
    if not args.no_write:
        bl.write_section(c.name, text, summary=summary)


# ---- report ------------------------------------------------------------------------------------

def pooled(runs: list, side: str, gc: bool = True) -> float:
    """Median step over every kept step of every round; gc=False: each step less its garbage collection."""
    return bl.median([t - (0 if gc else g) for r in runs for t, g in zip(r[side]["step_s"], r[side]["gc_s"])])


def samples(runs: list, side: str | None = None) -> list:
    return [x for r in runs for k, v in r.items() if side in (None, k) for x in v["samples"]]


def round_ratios(runs: list, side: str, peer: str, gc: bool = True) -> list:
    """side / peer of each round (medians of its steps)."""
    return [pooled([r], side, gc) / pooled([r], peer, gc) for r in runs]


def round_table(c: Comparison, runs: list, hyb: list) -> str:
    everyone = hyb + [label for label, _ in c.trl_sides]
    rows = []
    for i, r in enumerate(runs):
        rows.append([i + 1] + [f"{pooled([r], side):.3f}" for side in everyone]
                    + [f"{pooled([r], side) / pooled([r], c.peer(side)):.2f}x" for side in hyb]
                    + bl.stamp([x for v in r.values() for x in v["samples"]]))
    rows.append(["all"] + [f"**{pooled(runs, side):.3f}**" for side in everyone]
                + [f"**{pooled(runs, side) / pooled(runs, c.peer(side)):.2f}x**" for side in hyb] + bl.stamp(samples(runs)))
    return bl.table(["round"] + [f"{side} s/step" for side in everyone]
                    + [f"{side} / {c.peer(side)}" for side in hyb] + bl.STAMP_HEADER, rows)


def stage_medians(runs: list, side: str) -> dict:
    return {k: bl.median([x for r in runs for x in r[side]["stages"][k]]) for k in runs[0][side]["stages"]}


def per_step(runs: list, side: str, fn) -> list:
    """fn(run of `side`, step index) for every kept step of every round."""
    return [fn(r[side], j) for r in runs for j in range(len(r[side]["step_s"]))]


def training_part(runs: list, side: str, outside: tuple) -> float:
    """Median over steps of the wall step minus its `outside` stages and its garbage collection, step by
    step (a difference of medians would carry the noise of each stage into it)."""
    return bl.median(per_step(runs, side, lambda run, j: run["step_s"][j] - run["gc_s"][j] - sum(
        run["stages"][k][j] for k in outside if k in run["stages"])))


def stage_table(runs: list, hyb: list, trl: list) -> str:
    rows = []
    for side in hyb + trl:
        total, stamp = pooled(runs, side), bl.stamp(samples(runs, side))
        items = list(stage_medians(runs, side).items())
        if side in hyb:  # what the trainer's own step timer leaves out of the window
            items.append(("outside timing_s/step (data fetch, logging)",
                          bl.median(per_step(runs, side, lambda run, j: run["wall_s"][j] - run["timing_s_step"][j]))))
        items.append(("garbage collection (all collections)", bl.median(per_step(runs, side, lambda run, j: run["gc_s"][j]))))
        for k, v in items:
            rows.append([side, k, f"{v:.3f}", f"{100 * v / total:.0f}%"] + stamp)
    return bl.table(["side", "stage", "s", "share of step"] + bl.STAMP_HEADER, rows)


def _ratio_cell(runs: list, side: str, peer: str, gc: bool) -> str:
    per_round = round_ratios(runs, side, peer, gc)
    return (f"**{pooled(runs, side, gc) / pooled(runs, peer, gc):.2f}x** {peer} ({pooled(runs, side, gc):.3f} s vs "
            f"{pooled(runs, peer, gc):.3f} s; rounds {min(per_round):.2f}-{max(per_round):.2f}x over {len(runs)})")


def report(c: Comparison, runs: list, args, prof: dict) -> tuple:
    """(section text, Summary rows)."""
    hyb, trl = [label for label, _ in c.sides()], [label for label, _ in c.trl_sides]
    for r in runs:  # the trainer's own timer, beside the wall window
        for side in hyb:
            r[side]["timing_s_step"] = r[side].pop("step_s")
            r[side]["step_s"] = r[side]["wall_s"]
    ratios = {side: pooled(runs, side) / pooled(runs, c.peer(side)) for side in hyb}
    verdict = lambda x: "met" if x <= 0.5 else f"missed: {x / 0.5:.1f}x off the target"  # noqa: E731
    training = {side: training_part(runs, side, ("gen", "update_weights")) for side in hyb}
    training.update({side: training_part(runs, side, (c.trl_rollout_stage,)) for side in trl})
    passes = {side: c.passes(side, stage_medians(runs, side)) for side in hyb + trl}
    bounds = {side: bl.median([r[side]["bound_s"] for r in runs]) for side in passes}
    target = "; ".join(f"{side} **{x:.2f}x** {c.peer(side)} ({verdict(x)})" for side, x in ratios.items())
    reruns = sum(v["attempts"] - 1 for r in runs for v in r.values())
    text = (f"## {c.title}\n\nMedian wall seconds per step, end of one step to the end of the next on both sides "
            f"(steps 2..{args.steps} of each run; {args.rounds} rounds, the sides' order rotating each round; a run "
            f"whose 1-minute load at its end exceeded {args.rerun_load:g} ran again once, {reruns} time(s) in this run; "
            f"each run waited up to {args.max_wait:g} s for the load to fall below 2.5), "
            f"{c.setup}, fp32, 2 threads, AdamW lr {c.lr:g}{c.notes.get('sides', '')}.\n\n"
            + round_table(c, runs, hyb)
            + f"\n\nTarget hybridrl <= 0.5x TRL: {target}. Without garbage collection on either side (each step "
            f"less its own collections): " + "; ".join(f"{side} " + _ratio_cell(runs, side, c.peer(side), False) for side in hyb)
            + f". Mean response lengths seen: {lengths(runs, hyb + trl)}{c.notes.get('lengths', '')}.\n\n"
            f"Stage medians (hybridrl: timing_s/*, and what "
            f"its step timer leaves out of the wall window; TRL: the methods named timed inside its trainer, the "
            f"rest of its window is its training part, loader and logging; garbage collection on both sides "
            f"through `gc.callbacks`):\n\n" + stage_table(runs, hyb, trl)
            + f"\n\nTraining part (median over steps of the wall step minus generation, minus garbage collection, "
            f"and for hybridrl minus update_weights; TRL: minus {c.trl_rollout_stage}) against the matmul-only time "
            f"of the passes that ran, over the same tokens, on this machine{c.notes.get('bound', '')}. "
            f"One bound per round shared by every side: each distinct pass shape timed once after the round's "
            f"runs; projections over every token, attention as batched matmuls over the causal half, the head over "
            f"the response positions only; the median over rounds is shown:"
            f"\n\n" + bound_table(passes, training, bounds, {side: bl.stamp(samples(runs, side)) for side in passes})
            + "\n\n" + profile_text(prof, c.profiled) + f"\n\nPeer: {trl_versions(args.trl_python)}.")
    summary = [[f"{c.name.upper()} step <= 0.5x TRL ({side}{'' if gc else ', both sides without garbage collection'})",
                _ratio_cell(runs, side, c.peer(side), gc), verdict(pooled(runs, side, gc) / pooled(runs, c.peer(side), gc))]
               + bl.stamp(samples(runs)) for side in hyb for gc in (True, False)]
    return text, summary


def lengths(runs: list, sides: list) -> str:
    seen = {side: sorted({round(x, 2) for r in runs for x in r[side]["completion_len"]}) for side in sides + ["TRL"]}
    return ", ".join(f"{side} {v}" for side, v in seen.items())


# ---- FLOP-bound time ---------------------------------------------------------------------------

def _matmul_s(*shapes: tuple, reps: int = 9) -> float:
    """Median seconds of one fp32 matmul of random operands of `shapes` on this machine (2 threads):
    torch.mm of [m, k] @ [k, n], torch.bmm of [b, m, k] @ [b, k, n]."""
    import torch

    x, y = (torch.randn(*shape) for shape in shapes)
    op = torch.mm if x.dim() == 2 else torch.bmm
    op(x, y)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op(x, y)
        times.append(time.perf_counter() - start)
    return bl.median(times)


def _gemm_s(m: int, k: int, n: int) -> float:
    return _matmul_s((m, k), (k, n))


def _bmm_s(b: int, m: int, k: int, n: int) -> float:
    return _matmul_s((b, m, k), (b, k, n))


def matmul_seconds(p: Pass) -> float:
    """The matmuls of one pass (with backward: data and weight gradients timed as their own shapes) of the
    bench model: every projection over rows x seq_len tokens; attention as batched matmuls (QK^T and PV
    per row and head, with backward dS, dV, dQ, dK) over the causal half (the full square over half the
    (row, head) pairs: the same FLOPs); the LM head (or the critic's [H, 1] value head) over rows x
    head_len positions. No other op is counted."""
    import torch

    torch.set_num_threads(2)
    m = bl.BENCH_MODEL
    h, heads, kv, inter = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"], m["intermediate_size"]
    d, tokens, s = h // heads, p.rows * p.seq_len, p.seq_len
    linears = [(tokens, h, (heads + 2 * kv) * d), (tokens, heads * d, h), (tokens, h, 2 * inter),
               (tokens, inter, h)] * m["num_hidden_layers"]
    linears.append((p.rows * p.head_len, h, m["vocab_size"] if p.lm_head else 1))
    total = 0.0
    for rows, k, n in linears:
        total += _gemm_s(rows, k, n)
        if p.backward:
            total += _gemm_s(rows, n, k) + _gemm_s(k, rows, n)  # dX = dY W^T, dW = X^T dY
    pairs = max(1, p.rows * heads // 2)
    scores, values = _bmm_s(pairs, s, d, s), _bmm_s(pairs, s, s, d)  # QK^T; PV (and dV, dQ, dK: same shape)
    attention = scores + values + ((scores + 3 * values) if p.backward else 0.0)
    return total + attention * m["num_hidden_layers"]


def bound_table(passes: dict, measured: dict, bounds: dict, stamps: dict) -> str:
    """passes: side -> [Pass], the passes that ran; measured: side -> training s; bounds: side -> their
    matmul-only s; stamps: side -> STAMP_HEADER cells."""
    rows = []
    for side, items in passes.items():
        bound = bounds[side]
        names = " + ".join(p.label if p.times == 1 else f"{p.times} x {p.label}" for p in items)
        rows.append([side, names, f"{measured[side]:.3f}", f"{bound:.3f}", f"{measured[side] / bound:.1f}x"]
                    + stamps[side])
    return bl.table(["side", "training passes that ran (matmuls timed)", "measured s", "matmul-only s",
                     "measured / bound"] + bl.STAMP_HEADER, rows)
