"""Weight handoff bandwidth: `reshard.update_engine_weights` vs its layout's collectives alone and vs memcpy.

Two gloo processes hold the training model at TP=2 (then PP=2); each streams it into its own
NativeEngine at rollout TP 1 (the resharded path: megatron tensors written into the engine's own
layout, `reshard._send_layout`). In the same processes, in alternation with the handoffs, are timed
(C) the collectives alone the layout needs (`_transport_seconds`: the floor of any handoff over gloo
here) and (B) memcpy as the best sustained copy the machine does: the median of MEMCPY_COPIES copies
`dst.copy_(src)` of max(bytes handed over, 2 x the last-level cache) into a buffer allocated and paged
in once, with the handoff's threads (one per rank, both ranks at once). For the resharded rows, A and C each
run after one copy of that buffer (it evicts the cache, so both start from the same state) and a barrier; a
sample of either is the mean of enough runs to span SAMPLE_SECONDS (one ~20 ms timing here varies 2-3x); the
direct and shared rows time one handoff per rep. The handoff runs as the
trainer runs it (rollout.verify_weights=fingerprint) and without verification. At TP 2 two more
rows: an engine at rollout TP 2, once taking copies of the shards (direct path, share=False) and once
reading the training tensors themselves (shared path, nothing copied: its time is the identity check).
At PP 2 one more row, stage-read, the trainer's default there: an engine at rollout TP 1 = TP that reads its
own stage's layers from the training tensors and takes the other stage's, verified (timed with A and C).
In a separate, metered handoff per cell the peak extra memory (HandoffReport.peak_extra_bytes,
LiveTensorMeter) is compared, in bytes, with the bound first promised (one bucket + largest tensor)
and the widened one that also counts what the check allocates (HandoffReport.peak_bound_bytes).

    .venv/bin/python benchmarks/bench_reshard.py [--reps 3] [--models small,medium] [--no-write]
"""
from __future__ import annotations

import argparse
import os

import benchlib as bl

LAYOUTS = ((2, 1), (1, 2))  # (tp, pp) of the training model, world 2
BUCKETS_MB = (2, 64)
VERIFY = ("fingerprint", "off")
MEMCPY_COPIES = 20
SAMPLE_SECONDS = 0.15  # a timing sample of A and of C spans about this long (`runs` handoffs, each timed alone)
MODELS = {"small": {},  # the bench model, ~10 MB fp32
          "medium": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, vocab_size=8192)}


def last_level_cache_bytes() -> int:
    """The largest CPU cache (sysfs), 64 MiB where it cannot be read."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip()
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
    return max(sizes, default=64 * 2**20)


def reinit_parallel(tp: int, pp: int):
    """Fresh megatron parallel_state with a new (tp, pp) layout inside one launch."""
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.distributed import init_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return init_model_parallel(tp, pp)


def _memcpy_seconds(src, dst) -> list:
    """Seconds per byte of MEMCPY_COPIES back-to-back copies (each timed alone)."""
    return [bl.timed(dst.copy_, src)[0] / src.numel() for _ in range(MEMCPY_COPIES)]


_BUFFERS: dict = {}


def _reused(numel: int, dtype):
    """A buffer of at least numel elements, allocated and paged in once per process (a fresh one per call
    would put page faults in the collectives' time, which the handoff's engine, written in place, never pays)."""
    import torch

    buf = _BUFFERS.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _BUFFERS[dtype] = torch.zeros(numel, dtype=dtype)
    return buf[:numel]


def _transport_seconds(model, spec, groups) -> float:
    """The collectives alone that the handoff needs in this layout, into one reused buffer: an
    all-gather of every TP-split shard (TP), or a broadcast of every tensor from its stage (PP). No
    reordering, no copy into an engine, no fingerprint: the floor of any handoff over gloo here."""
    import time

    import torch
    import torch.distributed as dist

    from hybridrl.models import hf_convert as hc
    from hybridrl.models.hf_checkpoint import weight_state
    from hybridrl.placement.reshard import _all_gather_single

    offset = hc.layer_range(spec.num_layers, groups.pp, groups.pp_rank).start
    local = {hc.local_to_global(k, offset): v.detach() for k, v in weight_state(model).items()}
    names = list(hc.hf_to_mcore_name_map(spec))
    sizes = {g: torch.Size(hc.mcore_full_shape(g, spec, groups.tp)).numel() for g in names}
    buf = _reused(max(sizes.values()), next(iter(local.values())).dtype)
    dist.barrier()
    start = time.perf_counter()
    for g in names:
        if groups.pp > 1:
            owner = hc.owner_stage(g, spec, groups.pp)
            full = buf[:sizes[g]]
            if groups.pp_rank == owner:
                full.copy_(local[g].reshape(-1))
            dist.broadcast(full, group=groups.pp_group, group_src=owner)
        elif groups.tp > 1 and hc.tp_split_dim(g) is not None:
            shard = local[g].contiguous().reshape(-1)
            _all_gather_single(buf[:groups.tp * shard.numel()], shard, group=groups.tp_group)
    return time.perf_counter() - start


def _cell(out: dict, key: tuple) -> dict:
    return out.setdefault(key, {"handoff": [], "memcpy": [], "transport": [], "samples": []})


def body(folder: str, reps: int) -> dict:
    """Per rank: {(tp, pp, path, bucket_mb, verify): {"handoff": [s], "memcpy": [s per byte], "transport": [s],
    "report": last, "metered": report}}; path "resharded" (rollout TP 1), "direct" or "shared" (rollout TP 2)."""
    import torch
    import torch.distributed as dist

    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.placement.reshard import update_engine_weights
    from hybridrl.rollout.native import NativeEngine

    out = {}
    for tp, pp in LAYOUTS:
        groups = reinit_parallel(tp, pp)
        model, spec = model_from_hf(folder, groups)
        engine = NativeEngine(spec, 1)
        for _ in range(2):  # the second is timed warm
            warm = update_engine_weights(engine, model, spec, groups, BUCKETS_MB[-1], share=False)
        size = max(warm.total_bytes, 2 * last_level_cache_bytes())
        src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
        _memcpy_seconds(src, dst)  # both buffers paged in before any timing
        # one handoff of the small model takes ~20 ms, and one such timing on 2 shared cores varies 2-3x from
        # run to run: a sample averages enough runs to span SAMPLE_SECONDS
        slowest = torch.tensor([warm.seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank must run the same number of collectives
        runs = max(1, round(SAMPLE_SECONDS / slowest.item()))
        # the trainer's own layout (rollout TP = TP): an engine taking copies and one reading the training tensors
        equal = {path: NativeEngine(spec, tp) for path in ("direct", "shared")} if tp > 1 else {}
        # PP 2 at TP 1 = rollout TP: the trainer's default, the engine reads its stage's layers, copies the other's
        staged = NativeEngine(spec, 1) if pp > 1 else None
        for _ in range(2 if staged is not None else 0):
            update_engine_weights(staged, model, spec, groups, BUCKETS_MB[-1])
        for _ in range(reps):
            for bucket_mb in BUCKETS_MB:
                for verify in VERIFY:
                    cell = _cell(out, (tp, pp, "resharded", bucket_mb, verify))
                    cell["samples"].append(bl.sample())
                    cell["memcpy"] += _memcpy_seconds(src, dst)  # B, same process, same threads
                    # A and C, each after one copy of the buffer (it evicts the cache, so both start from the same
                    # state) and a barrier (a rank's lead is counted in neither); a sample is the mean of `runs`
                    hand = trans = read = 0.0
                    stage = staged if bucket_mb == BUCKETS_MB[-1] and verify == VERIFY[0] else None
                    for _ in range(runs):
                        dst.copy_(src)
                        dist.barrier()
                        report = update_engine_weights(engine, model, spec, groups, bucket_mb, verify=verify,
                                                       share=False)  # A
                        dst.copy_(src)
                        trans += _transport_seconds(model, spec, groups)  # C (its barrier inside)
                        hand += report.seconds
                        if stage is not None:  # A on the default path, in the same alternation
                            dst.copy_(src)
                            dist.barrier()
                            stage_report = update_engine_weights(stage, model, spec, groups, bucket_mb, verify=verify)
                            read += stage_report.seconds
                    cell["handoff"].append(hand / runs)
                    cell["transport"].append(trans / runs)
                    cell["report"], cell["runs"] = report, runs
                    if stage is not None:
                        other = _cell(out, (tp, pp, "stage-read", bucket_mb, verify))
                        other["samples"].append(cell["samples"][-1])
                        other["memcpy"] = cell["memcpy"]
                        other["handoff"].append(read / runs)
                        other["transport"].append(trans / runs)
                        other["report"], other["runs"] = stage_report, runs
            for path, equal_engine in equal.items():
                cell = _cell(out, (tp, pp, path, BUCKETS_MB[-1], VERIFY[0]))
                cell["samples"].append(bl.sample())
                report = update_engine_weights(equal_engine, model, spec, groups, BUCKETS_MB[-1],
                                               share=path == "shared")
                cell["handoff"].append(report.seconds)
                cell["memcpy"] += _memcpy_seconds(src, dst)
                cell["report"] = report
        for bucket_mb in BUCKETS_MB:  # memory, metered apart: the meter sees every op and slows the stream
            out[tp, pp, "resharded", bucket_mb, VERIFY[0]]["metered"] = update_engine_weights(
                engine, model, spec, groups, bucket_mb, measure_memory=True, share=False)
        del model, engine, equal, staged, src, dst
    return out


def _rows(name: str, res: dict):
    speed, memory = [], []
    for (tp, pp, path, bucket_mb, verify), cell in res.items():
        r = cell["report"]
        hand, per_byte = bl.median(cell["handoff"]), bl.median(cell["memcpy"])
        layout = f"TP={tp}" if tp > 1 else f"PP={pp}"
        engine = f"rollout TP {1 if path in ('resharded', 'stage-read') else tp}, {path}"
        if path == "shared":
            speed.append([name, "0 (reads the training tensors)", layout, engine, "-", r.verify, f"{hand * 1e3:.2f} ms",
                          "-", "-", "-", "-"] + bl.stamp(cell["samples"]))
            continue
        copy_rate, hand_rate = 1 / per_byte / 2**30, r.total_bytes / hand / 2**30
        # ratios per rep (A and C timed moments apart), then their median: the load moves between reps
        wire = (f"{100 * bl.median([c / h for c, h in zip(cell['transport'], cell['handoff'])]):.1f}%"
                if cell["transport"] else "- (no collective)")
        bold = wire if not cell["transport"] or verify != VERIFY[0] or bucket_mb != 64 else f"**{wire}**"
        speed.append([name, f"{r.total_bytes / 2**20:.1f}", layout, engine, bucket_mb, verify,
                      f"{hand_rate:.2f} GiB/s", f"{copy_rate:.2f}", bold, f"{100 * hand_rate / copy_rate:.1f}%",
                      f"{100 * r.total_bytes * per_byte / bl.median(cell['transport']):.1f}%" if cell["transport"]
                      else "-"] + bl.stamp(cell["samples"]))
        if "metered" in cell:
            m = cell["metered"]
            first = max(m.bucket_bytes, m.max_bucket_bytes) + m.largest_tensor_bytes
            memory.append([name, layout, bucket_mb, m.num_buckets, f"{m.peak_extra_bytes:,}", f"{first:,}",
                           "met" if m.peak_extra_bytes <= first else "**over**", f"{m.verify_bytes:,}",
                           f"{m.peak_bound_bytes:,}", f"{m.peak_extra_bytes / m.peak_bound_bytes:.4f}",
                           "met" if m.peak_extra_bytes <= m.peak_bound_bytes else "**over**"] + bl.stamp(cell["samples"]))
    return speed, memory


def _pct(cell: str) -> float:
    return float(cell.strip("*%"))


def report(results: dict, reps: int) -> tuple:
    """(section text, Summary rows)."""
    speed, memory = [], []
    for name, res in results.items():
        s, m = _rows(name, res)
        speed += s
        memory += m
    verified = [r for r in speed if r[5] == VERIFY[0] and r[4] == 64]
    # each layout's handoff as the trainer runs it: TP 2 -> rollout TP 1 resharded, PP 2 -> 1 stage-read
    target = [r for r in verified if r[3].endswith("resharded") and r[2].startswith("TP")
              or r[3].endswith("stage-read")]
    copied = [r for r in verified if r[3].endswith("resharded") and r[2].startswith("PP")]
    worst, copied_worst = (min(rows, key=lambda r: _pct(r[8])) for rows in (target, copied))
    verdict, copied_verdict = ("met" if _pct(w[8]) >= 70 else f"missed by {70 / _pct(w[8]):.2f}x"
                               for w in (worst, copied_worst))
    copy_worst = min(target, key=lambda r: _pct(r[9]))
    over_first = [r for r in memory if r[6] != "met"]
    over_wide = [r for r in memory if r[10] != "met"]
    cells = lambda rows: ", ".join(f"{r[0]} {r[1]} {r[2]} MiB" for r in rows)  # noqa: E731
    first_text = (f"{len(over_first)} of {len(memory)} cells over the bound first promised ({cells(over_first)})"
                  if over_first else f"all {len(memory)} cells within the bound first promised")
    wide_text = (f"{len(over_wide)} of {len(memory)} cells over the widened bound ({cells(over_wide)})"
                 if over_wide else f"all {len(memory)} cells within the widened bound")
    shared = [r for r in speed if r[3].endswith("shared")]
    direct = [r for r in speed if r[3].endswith("direct")]
    runs_text = "; ".join(f"{name} " + ", ".join(f"{'TP' if tp > 1 else 'PP'}=2: {c['runs']}" for (tp, pp, path, b, v), c
                                                  in res.items() if path == "resharded" and b == 64 and v == VERIFY[0])
                          for name, res in results.items())
    text = (f"## Reshard: weight handoff vs memcpy\n\n"
            f"Training layout world 2 -> NativeEngine on each rank, fp32, 1 thread per rank, medians of {reps} "
            f"alternating reps; for the resharded rows a sample of A or C is the mean of `runs` back-to-back "
            f"runs, each after a copy of the memcpy buffer (it evicts the cache) and a barrier, `runs` = "
            f"round({SAMPLE_SECONDS} s / the slowest rank's handoff) ({runs_text}); the direct and shared rows time "
            f"one handoff per rep. handoff A: `update_engine_weights` (resharded = megatron tensors into the engine's "
            f"own layout at rollout TP 1; direct = copies of the shards into an engine at the training layout; "
            f"shared = that engine reads the training tensors, nothing copied, the identity check timed; stage-read = "
            f"PP 2's default at rollout TP 1 = TP: the engine reads its own stage's layers from the training tensors "
            f"(identity check) and takes the other stage's, verified; timed in the same alternation as the resharded "
            f"cell and against the same C; `MiB stored` = what it copies); "
            f"memcpy B: the median of {MEMCPY_COPIES} copies per rep of max(bytes handed over, 2 x the "
            f"{last_level_cache_bytes() // 2**20} MiB last-level cache) into a buffer allocated and paged in once, "
            f"the handoff's threads; collectives alone C: the layout's gloo all-gathers (TP) or broadcasts (PP) into "
            f"one reused buffer (`_transport_seconds`), the floor of any handoff over gloo here. Rates are GiB/s per "
            f"rank; `handoff / collectives alone` is the median over reps of C's time / A's (timed moments apart, so "
            f"a change of load between reps cancels); `load 1-min` is the range over the cell's reps.\n\n"
            + bl.table(["model", "MiB stored", "training", "engine", "bucket MiB", "verify", "handoff",
                        "memcpy GiB/s", "handoff / collectives alone", "handoff / memcpy",
                        "collectives alone / memcpy"] + bl.STAMP_HEADER, speed)
            + f"\n\nTarget: the verified (fingerprint) 64 MiB handoff >= 70% of its layout's collectives-alone "
            f"throughput, each layout's handoff as the trainer runs it (TP 2 -> rollout TP 1: resharded into the "
            f"engine's layout; PP 2 -> rollout TP 1: stage-read), both models: "
            + ", ".join(f"{r[0]} {r[2]} {r[8].strip('*')}" for r in target)
            + f"; worst {worst[8].strip('*')} ({worst[0]}, {worst[2]}, {worst[3].split(', ')[1]}; {verdict}). Against "
            f"memcpy the same cells reach {copy_worst[9]} at worst ({copy_worst[0]}, {copy_worst[2]}). PP 2 -> 1 with "
            f"every tensor copied (LoRA's merged weights, or rollout.share_weights=false: the own stage is copied "
            f"too, and digested at the source and where it is stored): "
            + ", ".join(f"{r[0]} {r[8].strip('*')}" for r in copied) + f" ({copied_verdict}).\n\n"
            f"Peak extra memory of one metered, verified resharded handoff (HandoffReport.peak_extra_bytes, bytes) vs the "
            f"bound first promised (one bucket + largest tensor) and the widened one (+ what the fingerprint check "
            f"allocates, `reshard.verify_bytes`; HandoffReport.peak_bound_bytes). The resharded path holds no bucket "
            f"buffer: a bucket only groups the digests checked together.\n\n"
            + bl.table(["model", "training", "bucket MiB", "buckets", "peak B", "bucket + largest B", "vs first bound",
                        "check's allowance B", "widened bound B", "peak / widened", "vs widened bound"]
                       + bl.STAMP_HEADER, memory)
            + f"\n\nPeak: {first_text}; {wide_text}.")
    samples = [x for res in results.values() for c in res.values() for x in c["samples"]]
    cores, load = os.cpu_count() or 1, max(load for _, load in samples)
    if load > cores:
        text += (f"\n\nMore was runnable than there are cores while this ran (1-minute load up to {load:.1f} on {cores} "
                 f"cores, the bench's own two ranks included): every rate above is what two ranks got of it, and the "
                 f"ratios of timings taken moments apart carry that noise.")
    summary = [["reshard verified 64 MiB handoff >= 70% of the collectives alone (as the trainer runs each layout: "
                "TP 2 -> 1 resharded, PP 2 -> 1 stage-read)",
                ", ".join(f"{r[0]} {r[2]} **{r[8].strip('*')}**" for r in target)
                + f"; vs sustained memcpy worst {copy_worst[9]}", verdict] + bl.stamp(samples),
               ["reshard PP 2 -> 1 with every tensor copied (LoRA merged weights, share_weights=false) >= 70% of the "
                "collectives alone", ", ".join(f"{r[0]} **{r[8].strip('*')}**" for r in copied), copied_verdict]
               + bl.stamp(samples),
               ["reshard peak <= one bucket + largest tensor (first promise), and <= + the check (widened)",
                f"{len(memory) - len(over_first)} of {len(memory)} within the first; "
                f"{len(memory) - len(over_wide)} of {len(memory)} within the widened; "
                f"worst peak / widened {max(float(r[9]) for r in memory):.4f}",
                "met" if not over_first else f"{len(over_first)} of {len(memory)} over the first bound"]
               + bl.stamp(samples),
               ["reshard at equal layouts: shared reads the training tensors, direct copies the shards",
                "shared " + ", ".join(f"{r[0]} {r[6]}" for r in shared) + "; direct "
                + ", ".join(f"{r[0]} {r[6]} ({r[9]} of memcpy)" for r in direct),
                "shared copies 0 bytes"] + bl.stamp(samples)]
    return text, summary


def profile_handoff(folder: str) -> str:
    """cProfile of one verified handoff on rank 0 (TP=2), the evidence for where the time goes."""
    from dist_helper import run_distributed

    return run_distributed(_profile_body, 2, folder, timeout=600)[0]


def _profile_body(folder: str) -> str:
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.placement.reshard import update_engine_weights
    from hybridrl.rollout.native import NativeEngine

    groups = reinit_parallel(2, 1)
    model, spec = model_from_hf(folder, groups)
    engine = NativeEngine(spec, 1)
    update_engine_weights(engine, model, spec, groups, 64, share=False)
    return bl.profile_top(lambda: update_engine_weights(engine, model, spec, groups, 64, share=False), 14)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--models", default="small,medium")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    from dist_helper import run_distributed

    results, folders = {}, {}
    for name in args.models.split(","):
        folders[name] = bl.bench_model_folder(f"reshard_{name}", **MODELS[name])
        results[name] = run_distributed(body, 2, folders[name], args.reps, timeout=900)[0]
    text, summary = report(results, args.reps)
    name = args.models.split(",")[-1]
    text += (f"\n\n<details><summary>cProfile of one verified handoff, {name} model, TP=2, 64 MiB buckets, "
             f"rank 0</summary>\n\n```\n{profile_handoff(folders[name])}\n```\n\n</details>")
    print(text)
    if not args.no_write:
        bl.write_section("reshard", text, summary=summary)


if __name__ == "__main__":
    main()
