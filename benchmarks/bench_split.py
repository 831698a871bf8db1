"""Split placement vs colocated vs TRL: wall seconds per step on the same model, batch and 2 cores.

GRPO on the setup of bench_grpo_vs_trl.py, PPO on that of bench_ppo_vs_trl.py. Sides, run in
alternation per round, the order rotated by one side each round (round 2 starts with the second
side): colocated (1 process, 2 threads), split s=0 (torchrun: 1 trainer rank + 1 rollout rank, 1
thread each), split s=1 + stream m for each m of --stream-grpo/--stream-ppo (the same, staleness 1 and
stream_prompts m; m = 0: whole batches), and TRL (2 threads, as the benches run it). PPO: every hybridrl
side takes its old log-probs from a pass of its own (bypass_mode, the engine's log-probs, is refused at
staleness 1, so no side uses it; TRL takes them from generation). A step is the wall clock between
consecutive steps: hybridrl's TensorBoard events of consecutive steps (wall_time), TRL's consecutive
on_step_end; steps 2..--steps of every run. Split runs also report the per-step `perf/overlap` (share of
the step both roles compute: waits and weight transfers are no one's compute), `perf/idle/trainer` and
`perf/idle/rollout` (means over steps 2..--steps), and the same overlap from their timeline.json over the
whole wall window.

    .venv/bin/python benchmarks/bench_split.py [--algos grpo,ppo] [--rounds 3] [--steps 8] [--no-trl]
    .venv/bin/python benchmarks/bench_split.py --picture docs/timeline.png [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import benchlib as bl
import trl_compare as tc
from bench_grpo_vs_trl import GRPO
from bench_ppo_vs_trl import PPO
from hybridrl.timeline import busy_share, overlap, read_trace, role_groups

SPLIT = ("placement.mode=split", "placement.rollout_world_size=1")
BYPASS = "algorithm.rollout_correction.bypass_mode=true"  # PPO bench: not allowed at staleness 1, so on no side
STAGES = ("gen", "wait_rollout", "old_log_prob", "ref", "update_critic", "update_actor", "update_weights")


def sides(c: tc.Comparison, streams) -> list:
    """(label, processes, threads per process, overrides) of the hybridrl sides: one s=1 side per m."""
    base = [o for o in c.overrides if o != BYPASS]  # one old-log-prob source on every side
    async_ = base + list(SPLIT) + ["async_training.staleness_threshold=1"]
    return [("colocated", 1, 2, base), ("split s=0", 2, 1, base + list(SPLIT))] + [
        (f"split s=1 + stream {m}" if m else "split s=1", 2, 1, async_ + [f"async_training.stream_prompts={m}"])
        for m in streams]


# ---- machine state ----------------------------------------------------------------------------

def load1() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def others_running() -> list:
    return [p for p in ("demo_sweep", "pytest") if subprocess.run(["pgrep", "-f", p], capture_output=True).stdout]


WAIT_MIN = [40.0]  # the longest wait for other work, each time (--wait-min)


def wait_quiet(threshold: float = 99.0, poll_s: float = 30) -> str:
    """Wait until no demo sweep or pytest runs and the 1-minute load is < threshold (WAIT_MIN at most)."""
    start = time.time()
    while others_running() or load1() >= threshold:
        if time.time() - start > 60 * WAIT_MIN[0]:
            return (f"not quiet: gave up waiting after {(time.time() - start) / 60:.0f} min, load {load1():.2f}, "
                    f"running: {', '.join(others_running()) or 'nothing named'}")
        time.sleep(min(poll_s, 60 * WAIT_MIN[0]))  # never past the longest wait
    return f"quiet after {(time.time() - start) / 60:.1f} min of waiting (load {load1():.2f})"


def _busy_s() -> float:
    user, nice, system, _idle, _io, irq, softirq, steal = map(int, open("/proc/stat").readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def observed(fn):
    """fn() with the machine around it, once no demo sweep or pytest runs (wait_quiet): 1-minute load
    before (our own last run counts in it), other processes' CPU (cores) during."""
    waited = wait_quiet()
    load, busy, own, start, others = load1(), _busy_s(), _own_s(), time.time(), others_running()
    out = fn()
    foreign = (_busy_s() - busy) - (_own_s() - own)
    return dict(out, load=load, foreign=max(foreign, 0.0) / (time.time() - start), others=others, waited=waited)


# ---- runs -------------------------------------------------------------------------------------

def hybridrl_run(nproc, threads, overrides, run_dir, steps) -> dict:
    tl_dir = os.path.join(run_dir, "timeline")
    out = tc.run_hybridrl(run_dir, steps, overrides + [f"trainer.timeline_dir={tl_dir}"], STAGES + ("step",),
                          {"OMP_NUM_THREADS": str(threads)}, nproc)
    s = bl.read_scalars(os.path.join(run_dir, "tb"))
    events = read_trace(os.path.join(tl_dir, "timeline.json"))
    window = (out["logged_at"][0] * 1e6, out["logged_at"][-1] * 1e6)  # steps 2..N
    groups = role_groups(events)
    out["busy"] = {role: busy_share(events, ranks, window) for role, ranks in groups.items()}
    out["overlap"] = overlap(events, groups, window) if len(groups) > 1 else None
    for key in ("perf/overlap", "perf/idle/trainer", "perf/idle/rollout"):
        out[key] = [s[key][i] for i in range(2, steps + 1) if i in s.get(key, {})]
    out["staleness"] = [s["rollout/staleness/mean"][i] for i in range(2, steps + 1) if "rollout/staleness/mean" in s]
    return out


def trl_run(c, trl_python, run_dir, steps) -> dict:
    args = [bl.bench_model_folder(), bl.bench_tokenizer_folder(), tc.prompts_json(), run_dir, steps, c.lr]
    out = tc.run_trl(trl_python, c.trl_script, args, {"wall_s": "wall"})
    return dict(out, wall_s=out["stages"]["wall"])


def rounds(c, args, streams, trl_python) -> list:
    """[{side label: run}] per round (in the listed order), the order of the runs rotated by one each round."""
    out = []
    runs = [(label, (nproc, threads, overrides)) for label, nproc, threads, overrides in sides(c, streams)]
    runs += [("TRL", None)] if trl_python else []
    for i in range(args.rounds):
        row = {}
        for label, how in runs[i % len(runs):] + runs[:i % len(runs)]:
            if how is None:
                row[label] = observed(lambda: trl_run(c, trl_python, os.path.join(bl.WORK, f"split_{c.name}_trl_{i}"),
                                                      args.steps))
                continue
            run_dir = os.path.join(bl.WORK, f"split_{c.name}_{label.replace(' ', '_').replace('=', '')}_{i}")
            row[label] = observed(lambda: hybridrl_run(*how, run_dir, args.steps))
        row = {label: row[label] for label, _ in runs}
        print(f"{c.name} round {i + 1}: " + ", ".join(f"{k} {bl.median(v['wall_s']):.3f} s (load {v['load']:.2f})"
                                                       for k, v in row.items()), flush=True)
        out.append(row)
        with open(os.path.join(bl.WORK, f"split_{c.name}_runs.json"), "w") as f:  # the raw figures so far
            json.dump(out, f)
    return out


# ---- report -----------------------------------------------------------------------------------

def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def summary(runs: list) -> dict:
    """Per side: pooled median of wall_s, per-round medians, and the means of the split figures."""
    out = {}
    for label in runs[0]:
        rs = [r[label] for r in runs]
        per_round = [bl.median(r["wall_s"]) for r in rs]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        out[label] = {"median": bl.median([x for r in rs for x in r["wall_s"]]), "rounds": per_round,
                      "internal": bl.median([x for r in rs for x in r.get("step_s", [])]) if "busy" in rs[0] else None,
                      "overlap": mean([r["overlap"] for r in rs if r.get("overlap") is not None]),
                      **{k: mean([x for r in rs for x in r.get(k, [])])
                         for k in ("perf/overlap", "perf/idle/trainer", "perf/idle/rollout")},
                      "staleness": mean([x for r in rs for x in r.get("staleness", [])]),
                      "loads": [r["load"] for r in rs], "foreign": max(r["foreign"] for r in rs),
                      "stages": {k: bl.median([x for r in rs for x in r["stages"].get(k, [])])
                                 for k in STAGES if rs[0]["stages"].get(k)} if "busy" in rs[0] else {}}
    return out


NOISY = 0.5
"""Cores other processes may use during a run before the speed targets are not judged (of 2)."""


def section(c, runs, args, stamp: dict) -> str:
    s = summary(runs)
    worst = max(v["foreign"] for v in s.values())
    noisy = f"not judged: other processes used up to {worst:.2f} of 2 cores during a run" if worst > NOISY else None
    colo, trl = s["colocated"]["median"], s["TRL"]["median"] if "TRL" in s else None
    rows = []
    for label, v in s.items():
        rows.append([label, f"**{v['median']:.3f}** [{min(v['rounds']):.3f}-{max(v['rounds']):.3f}]",
                     f"{v['median'] / colo:.2f}x", f"{v['median'] / trl:.2f}x" if trl else "-",
                     f"{v['internal']:.3f}" if v["internal"] else "-", _pct(v["perf/overlap"]),
                     _pct(v["perf/idle/trainer"]), _pct(v["perf/idle/rollout"]), _pct(v["overlap"]),
                     "-" if v["staleness"] is None else f"{v['staleness']:.2f}",
                     f"{min(v['loads']):.2f}-{max(v['loads']):.2f}", f"{v['foreign']:.2f}",
                     stamp["commit"], stamp["date"]])
    table = bl.table(["side", "wall s/step median [round medians]", "/ colocated", "/ TRL", "timing_s/step",
                      "perf/overlap", "perf/idle/trainer", "perf/idle/rollout", "overlap (timeline, wall window)",
                      "staleness", "load 1-min before", "other CPU (cores)", "commit", "date"], rows)
    stage_rows = [[label, k, f"{x:.3f}"] for label, v in s.items() for k, x in v["stages"].items()]
    best = min((v["median"], k) for k, v in s.items() if k.startswith("split"))
    rows_stamp = stamp["cells"]
    verdicts = [f"split <= 0.6x colocated: best split side ({best[1]}) **{best[0] / colo:.2f}x** "
                f"({noisy or ('met' if best[0] / colo <= 0.6 else 'missed')})"]
    summary_rows = [[f"{c.name.upper()} split step <= 0.6x colocated", f"best split side ({best[1]}) "
                     f"**{best[0] / colo:.2f}x** ({best[0]:.3f} s vs {colo:.3f} s, wall window)",
                     noisy or _verdict(best[0] / colo, 0.6)] + rows_stamp]
    if trl:
        fastest = min((v["median"], k) for k, v in s.items() if k != "TRL")
        verdicts.append(f"<= 0.5x TRL: best hybridrl side ({fastest[1]}) **{fastest[0] / trl:.2f}x** "
                        f"({noisy or ('met' if fastest[0] / trl <= 0.5 else 'missed')})")
    ov = [(v["perf/overlap"], k) for k, v in s.items() if k.startswith("split s=1") and v["perf/overlap"] is not None]
    verdicts += [f"perf/overlap > 85% ({k}): **{_pct(o)}**, idle trainer {_pct(s[k]['perf/idle/trainer'])}, "
                 f"idle rollout {_pct(s[k]['perf/idle/rollout'])} ({'met' if o > 0.85 else 'missed'})" for o, k in ov]
    if ov:
        o, k = max(ov)
        summary_rows.append([f"{c.name.upper()} split s=1 overlap > 85%", f"best perf/overlap **{_pct(o)}** ({k}), "
                             f"idle trainer {_pct(s[k]['perf/idle/trainer'])}, rollout "
                             f"{_pct(s[k]['perf/idle/rollout'])}",
                             "met" if o > 0.85 else f"missed by {100 * (0.85 - o):.0f} points"] + rows_stamp)
    text = (f"### {c.name.upper()} ({c.setup})\n\n{table}\n\n" + "; ".join(verdicts) + ".\n\n"
            f"<details><summary>{c.name.upper()} stage medians of the hybridrl sides (timing_s/*, trainer rank)"
            f"</summary>\n\n" + bl.table(["side", "stage", "s"], stage_rows) + "\n\n</details>")
    return text, summary_rows


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else f"missed: {ratio / target:.1f}x off the target"


def picture(png: str, steps: int, stream: int) -> None:
    """A short colocated run and a short split s=1 + stream run of the GRPO setup, drawn one above the other."""
    folder, traces = os.path.join(bl.WORK, "timeline"), []
    for label, nproc, threads, overrides in sides(GRPO, [stream])[::2]:
        name = "colocated" if nproc == 1 else f"split_s1_stream{stream}"
        run_dir = os.path.join(folder, name)
        tc.run_hybridrl(run_dir, steps, overrides + [f"trainer.timeline_dir={run_dir}"], (),
                        {"OMP_NUM_THREADS": str(threads)}, nproc)
        traces.append(os.path.join(folder, f"{name}.json"))
        shutil.copy(os.path.join(run_dir, "timeline.json"), traces[-1])  # the file name titles its panel
    cmd = [sys.executable, os.path.join(bl.ROOT, "scripts", "plot_timeline.py"), *traces, "-o", png]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=bl.ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algos", default="grpo,ppo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stream-grpo", default="2,0", help="prompts per chunk, one s=1 side each (2 prompts = 8 rows)")
    p.add_argument("--stream-ppo", default="8,0", help="prompts per chunk, one s=1 side each (8 prompts = 8 rows)")
    p.add_argument("--no-trl", action="store_true", help="hybridrl sides only")
    p.add_argument("--wait-min", type=float, default=40, help="longest wait for a quiet machine, each time")
    p.add_argument("--picture", help="draw docs/timeline.png instead of timing")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.picture:
        return picture(args.picture, args.steps, int(args.stream_grpo.split(",")[0]))
    WAIT_MIN[0] = args.wait_min
    quiet = wait_quiet(threshold=0.7)
    print(quiet, flush=True)
    started = bl.sample()
    parts, summary_rows = [], []
    for c, stream in ((GRPO, args.stream_grpo), (PPO, args.stream_ppo)):
        if c.name in args.algos.split(","):
            trl_python = None if args.no_trl else os.path.join(bl.ROOT, c.trl_venv, "bin", "python")
            if trl_python and not os.path.exists(trl_python):
                print(f"no {trl_python}: {c.name} runs without its TRL side", flush=True)
                trl_python = None
            runs = rounds(c, args, [int(m) for m in stream.split(",")], trl_python)
            loads = [side["load"] for r in runs for side in r.values()]
            stamp = {"commit": bl.commit(), "date": bl.stamp([started])[2],
                     "cells": bl.stamp([started] + [(started[0], x) for x in loads])}
            text, rows = section(c, runs, args, stamp)
            parts.append(text)
            summary_rows += rows
    text = ("## Split placement: split vs colocated vs TRL\n\n"
            f"Wall seconds per step (consecutive steps' log events; steps 2..{args.steps} of each run; {args.rounds} "
            "rounds, the order of the sides rotated by one each round), same model, batch and 2 cores for every "
            "side; PPO: old log-probs from a pass of their own on every hybridrl side. "
            f"Machine before the first run: {quiet}; `other CPU` is what other processes used during a run "
            "(cores, the worst run of the side).\n\n" + "\n\n".join(parts))
    print(text)
    if not args.no_write:
        bl.write_section("split", text, summary=summary_rows)


if __name__ == "__main__":
    main()
