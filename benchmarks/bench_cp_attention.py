"""Per-rank memory and time of context-parallel attention (`models/context_parallel.py`) on CPU:
one 16k-token sequence at CP 1 (one process, plain causal SDPA) and at CP 2 (two gloo processes,
K/V all-gathered, each rank's chunks in masked query blocks of 512 and 1024 rows recomputed in
backward), against CP 2 with the whole bottom-right mask of each chunk built once and kept for
backward (what `causal_lower_right` does on CPU).

fp32, 8 query heads, 2 KV heads, head dim 64; loss = sum(out * w). Memory, per rank, of one forward +
backward, by two meters: `reshard.LiveTensorMeter` (a TorchDispatchMode that sees every aten op, in
backward and in the blocks recomputed there too, and counts the storages allocated and still alive:
"held after forward" is the output plus what autograd keeps for backward, "peak" the most alive at
once), and the process's peak RSS increase (`ru_maxrss`, taken once per fresh process around the
first step). Times: wall seconds of forward + backward per rank, median of the repeats (the first
included; the all-gather is in them), and the CPU seconds of the calling thread.
`.venv/bin/python benchmarks/bench_cp_attention.py [--reps 2] [--tokens 16384]`
"""
from __future__ import annotations

import argparse

import benchlib
from dist_helper import run_distributed

HEADS, GROUPS, HEAD_DIM = 8, 2, 64


def _keeping_masks(plan):
    def kept(*args):
        return [(q0, q1, k0, k1, False) for q0, q1, k0, k1, _ in plan(*args)]
    return kept


def _rank(tokens: int, cp: int, block_rows: int, whole_mask: bool, reps: int) -> dict:
    import resource
    import time

    import torch
    import torch.distributed as dist

    from hybridrl.models import context_parallel
    from hybridrl.placement.reshard import LiveTensorMeter

    if block_rows or whole_mask:
        context_parallel.QUERY_BLOCK_ROWS = tokens if whole_mask else block_rows
    if whole_mask:  # one block per chunk, its graph (and mask) kept for backward instead of recomputed
        context_parallel._plan = _keeping_masks(context_parallel._plan)
    group, rank = (dist.group.WORLD, dist.get_rank()) if cp > 1 else (None, 0)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    g = torch.Generator().manual_seed(rank)
    local = tokens // cp
    q, k, v = (torch.randn(local, n, HEAD_DIM, generator=g).requires_grad_() for n in (HEADS, GROUPS, GROUPS))
    w = torch.randn(local, HEADS, HEAD_DIM, generator=g)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    walls, cpus, held, peak = [], [], 0, 0
    for rep in range(reps):
        q.grad = k.grad = v.grad = None
        if cp > 1:
            dist.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        with LiveTensorMeter() as meter:
            out = context_parallel.cp_attention(q, k, v, cu, group, HEAD_DIM ** -0.5)
            held = meter.current
            (out * w).sum().backward()
            del out
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
        peak = meter.peak
        if rep == 0:
            rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    return dict(held=held, peak=peak, rss=rss, wall=benchlib.median(walls), cpu=benchlib.median(cpus))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    cases = [("CP 1 (is_causal)", 1, 0, False)]
    cases += [(f"CP 2, blocks of {rows} rows", 2, rows, False) for rows in (512, 1024)]
    cases += [("CP 2, whole mask kept", 2, 0, True)]
    rows, base = [], None
    for name, cp, block_rows, whole_mask in cases:
        benchlib.wait_quiet()
        when = [benchlib.sample()]
        per_rank = run_distributed(_rank, cp, args.tokens, cp, block_rows, whole_mask, args.reps, timeout=900)
        when.append(benchlib.sample())
        worst = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
        base = base or worst
        mib = 2 ** 20
        rows.append([name, f"{worst['held'] / mib:.0f}", f"{worst['peak'] / mib:.0f}",
                     f"{worst['peak'] / base['peak']:.2f}", f"{worst['rss'] / mib:.0f}", f"{worst['wall']:.2f}",
                     f"{worst['cpu']:.2f}", f"{worst['wall'] / base['wall']:.2f}", *benchlib.stamp(when)])
        print(rows[-1], flush=True)
    header = ["case (worst rank)", "held after fwd MiB", "peak MiB", "peak / CP 1", "peak RSS + MiB", "wall s",
              "thread CPU s", "wall / CP 1", *benchlib.STAMP_HEADER]
    print(f"\n{args.tokens} tokens, {HEADS} heads / {GROUPS} KV heads x {HEAD_DIM}, fp32, forward + backward\n")
    print(benchlib.table(header, rows))
    print("\n" + benchlib.machine())


if __name__ == "__main__":
    main()
