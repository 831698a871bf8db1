"""Where a lean decode step's time beyond its matrix products goes: the same step at three model widths.

One decode step of `LeanGPT` (the native engine's default path) for a batch of 8 and of 32 rows, each with
50 cached positions (keys [0, 64) attended, the varied-length cells' masked form), on the rollout bench's
model (hidden 256) and on two wider ones (hidden 512, 1024: same 4 layers, same vocabulary), fp32, 2 torch
threads as `bench_rollout.py`. Beside it, in alternation, its matmul-only time: the step's GEMMs alone on
the same weights (each projection, the attention's two batched products over the cached keys, the head),
nothing else. `beyond` = step - matmul-only; `aten calls` = the operator calls one step dispatches (counted
once per model with a TorchDispatchMode). If `beyond` stays about the same as the GEMMs grow, it is a cost
per call (dispatch, Python, tiny kernels), not per byte or FLOP.

    .venv/bin/python benchmarks/bench_decode_width.py [--reps 7] [--no-write]
"""
from __future__ import annotations

import argparse
import time

import benchlib as bl

WIDTHS = {"h256 (rollout bench model)": {},
          "h512": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2),
          "h1024": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2)}
BATCHES = (8, 32)
CACHED, KEYS, STEPS = 50, 64, 40  # positions already cached, keys attended, steps per timing sample


def _per_step(fn) -> float:
    """Median seconds of STEPS calls, each timed alone."""
    times = sorted(bl.timed(fn)[0] for _ in range(STEPS))
    return times[len(times) // 2]


def _aten_calls(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def _gemms_only(lean, batch: int):
    """() -> None: the GEMMs of one decode step of `batch` rows over KEYS cached keys, nothing else."""
    import torch

    h, a = torch.randn(batch, lean.hidden), torch.randn(batch, lean.heads * lean.dim)
    f = torch.randn(batch, lean.layers[0].fc2.shape[0])
    pairs = batch * lean.groups_per_rank
    q, k = torch.randn(pairs, lean.rep, lean.dim), torch.randn(pairs, KEYS, lean.dim)

    def run():
        for w in lean.layers:
            torch.mm(h, w.qkv)
            torch.bmm(torch.bmm(q, k.transpose(1, 2)), k)
            torch.mm(a, w.proj)
            torch.mm(h, w.fc1)
            torch.mm(f, w.fc2)
        torch.mm(h, lean.output)
    return run


def _measure(reps: int) -> dict:
    import torch

    from bench_rollout import _engine
    from hybridrl.rollout.lean_decode import DecodeCache, LeanGPT

    torch.set_num_threads(2)
    out = {}
    for name, sizes in WIDTHS.items():
        engine = _engine(bl.bench_model_folder("decode_" + name.split()[0], **sizes))
        lean = LeanGPT(engine.model, engine.spec, engine.groups)
        for batch in BATCHES:
            cache = DecodeCache(lean, batch, 2 * KEYS)
            tokens = torch.randint(3, engine.spec.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
            pos = torch.full((batch,), CACHED)
            step = lambda: lean.decode(cache, tokens, pos, KEYS, True)  # noqa: E731
            gemms = _gemms_only(lean, batch)
            for fn in (step, gemms):  # warm
                _per_step(fn)
            cell = out[name, batch] = {"step": [], "gemms": [], "samples": [], "calls": _aten_calls(step)}
            for rep in range(reps):
                cell["samples"].append(bl.sample())
                for kind in (("step", "gemms") if rep % 2 == 0 else ("gemms", "step")):
                    cell[kind].append(_per_step(step if kind == "step" else gemms))
    return out


def report(results: dict, reps: int) -> tuple:
    rows, ratios = [], {}
    for (name, batch), c in results.items():
        step, gemms = bl.median(c["step"]), bl.median(c["gemms"])
        ratio = bl.median([s / g for s, g in zip(c["step"], c["gemms"])])
        ratios[name, batch] = ratio
        rows.append([name, batch, f"{step * 1e3:.2f}", f"{gemms * 1e3:.2f}", f"**{ratio:.2f}x**",
                     f"{(step - gemms) * 1e3:.2f}", c["calls"]] + bl.stamp(c["samples"]))
    beyond = [float(r[5]) for r in rows]
    text = ("## Decode step vs model width: lean's time beyond its GEMMs\n\n"
            f"One `LeanGPT.decode` step ({CACHED} cached positions, keys [0, {KEYS}) attended, masked), fp32, "
            f"2 torch threads, 4 layers, vocabulary 512; each sample the median of {STEPS} steps, {reps} samples "
            f"per cell alternating with the step's GEMMs alone (matmul-only); `step / matmul-only` is the median "
            f"of the per-sample ratios. The rollout bench's cells run the first model.\n\n"
            + bl.table(["model", "batch", "step ms", "matmul-only ms", "step / matmul-only", "beyond ms",
                        "aten calls per step"] + bl.STAMP_HEADER, rows)
            + f"\n\nBeyond the GEMMs: {min(beyond):.2f}-{max(beyond):.2f} ms per step across widths whose GEMMs "
            f"differ {max(float(r[3]) for r in rows) / min(float(r[3]) for r in rows):.0f}x.")
    first = next(iter(WIDTHS))
    summary = [["native decode step / matmul-only by model width (where lean's rest goes: a cost per call)",
                ", ".join(f"{name.split()[0]} b{batch} {ratios[name, batch]:.2f}x" for name, batch in ratios),
                f"<= 1.5x at b8 and b32 from h512; the bench model (h256) "
                f"{'met' if all(ratios[first, b] <= 1.5 for b in BATCHES) else 'not'}"]
               + bl.stamp([s for c in results.values() for s in c["samples"]])]
    return text, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    from dist_helper import run_distributed

    results = run_distributed(_measure, 1, args.reps, timeout=1800)[0]
    text, summary = report(results, args.reps)
    print(text)
    if not args.no_write:
        bl.write_section("decode-width", text, summary=summary)


if __name__ == "__main__":
    main()
