"""The checks and the report of benchmarks/gpu_check.sh (hybridrl's first GPU run), one subcommand each.

    gpu_check.py grpo-report --tb DIR --steps N --out FILE -- OVERRIDES...
        The GRPO run finished N steps with finite losses; its step times and step peak memory (its
        per-stage peaks against the planner are bench_gpu.py's fourth measurement, --memory-from).
    gpu_check.py resume-compare --init DIR --straight DIR --resumed DIR --out FILE
        HF exports of a straight run and of a run resumed from its mid-run checkpoint: their distance
        must be under 5% of how far the straight run moved from the initial weights (a resume that
        lost the optimizer's master weights lands about half-way back).
    gpu_check.py section --dir DIR --out FILE [--write]
        RESULTS.md's `gpu` section from the stage fragments in DIR (summary.md, tests.md, bench.md,
        grpo.md, resume.md), with the GPU and versions; --write also replaces it in benchmarks/RESULTS.md.
    gpu_check.py paste FILE
        Here, after a GPU run: put the section FILE that came back from it into benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import re
import statistics
import sys

import benchlib as bl

GIB = 2 ** 30


def median_after_first(series: dict) -> float:
    values = [v for step, v in sorted(series.items()) if step >= 2] or list(series.values())
    return statistics.median(values)


def grpo_report(args) -> int:
    scalars = bl.read_scalars(args.tb)
    losses = scalars.get("actor/pg_loss", {})
    done = sorted(step for step, v in losses.items() if math.isfinite(v))
    ok = done == list(range(1, args.steps + 1))
    step_s = median_after_first(scalars["timing_s/step"]) if "timing_s/step" in scalars else float("nan")
    timing = {k.split("/", 1)[1]: median_after_first(v) for k, v in scalars.items()
              if k.startswith("timing_s/") and k != "timing_s/step"}
    lines = [f"GRPO run: {len(done)} of {args.steps} steps with finite losses ({'PASS' if ok else 'FAIL'}); "
             f"median {step_s:.2f} s/step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(timing.items())) + " s.",
             "", f"Overrides of configs/tiny_cpu.yaml: `{' '.join(args.overrides)}`", ""]
    if "perf/max_memory_allocated_gb" in scalars:
        peak = {k: median_after_first(scalars[f"perf/max_memory_{k}_gb"]) for k in ("allocated", "reserved")}
        lines += [f"Step peak memory (median over steps 2..N): {peak['allocated']:.2f} GiB allocated, "
                  f"{peak['reserved']:.2f} GiB reserved; each stage's peak against the planner: bench_gpu.py."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    return 0 if ok else 1


def _hf_tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(path))
    if not out:
        raise SystemExit(f"no safetensors in {folder}")
    return out


def resume_compare(args) -> int:
    init, straight, resumed = (_hf_tensors(d) for d in (args.init, args.straight, args.resumed))
    if set(straight) != set(resumed) or set(straight) != set(init):
        raise SystemExit("the three exports do not hold the same tensors")
    sq = lambda a, b: sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in a)
    moved, apart = math.sqrt(sq(straight, init)), math.sqrt(sq(resumed, straight))
    ok = moved > 0 and apart <= 0.05 * moved
    text = (f"Resume with the distributed optimizer: |resumed - straight| = {apart:.4g}, |straight - initial| = "
            f"{moved:.4g}, ratio {apart / max(moved, 1e-30):.3f} (target <= 0.05): {'PASS' if ok else 'FAIL'}\n")
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    return 0 if ok else 1


def _gpu_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return "GPU: none (smoke run on CPU)"
    props = torch.cuda.get_device_properties(0)
    return f"GPU: {props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}"


def section(args) -> int:
    parts = ["## GPU (one H200): `benchmarks/gpu_check.sh`", ""]
    for name, title in (("summary.md", "Stages"), ("tests.md", "pytest -m cuda"), ("bench.md", "bench_gpu.py"),
                        ("grpo.md", "GRPO run (10 steps)"), ("resume.md", "Save + resume")):
        path = os.path.join(args.dir, name)
        if os.path.isfile(path):
            parts += [f"**{title}**", "", open(path).read().rstrip(), ""]
    body = "\n".join(parts)
    block = (f"<!-- BEGIN gpu -->\n{body.rstrip()}\n\n{_gpu_line()}; {bl.machine(('torch', 'megatron-core', 'transformers'))}."
             f"\n\nCommand: `benchmarks/gpu_check.sh`\n<!-- END gpu -->\n")
    with open(args.out, "w") as f:
        f.write(block)
    if args.write:
        _replace_section(block)
    return 0


def _replace_section(block: str) -> None:
    text = open(bl.RESULTS).read()
    pattern = re.compile(r"<!-- BEGIN gpu -->.*?<!-- END gpu -->\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block
    with open(bl.RESULTS, "w") as f:
        f.write(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grpo-report")
    g.add_argument("--tb", required=True)
    g.add_argument("--steps", type=int, required=True)
    g.add_argument("--out", required=True)
    g.add_argument("overrides", nargs="*")
    r = sub.add_parser("resume-compare")
    for name in ("--init", "--straight", "--resumed", "--out"):
        r.add_argument(name, required=True)
    s = sub.add_parser("section")
    s.add_argument("--dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--write", action="store_true")
    paste = sub.add_parser("paste")
    paste.add_argument("file")
    args = p.parse_args()
    if args.cmd == "paste":
        _replace_section(open(args.file).read())
        return 0
    return {"grpo-report": grpo_report, "resume-compare": resume_compare, "section": section}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
