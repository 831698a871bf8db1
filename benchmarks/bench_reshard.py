"""Weight handoff bandwidth: `reshard.update_engine_weights` vs a memcpy of the same bytes.

Two gloo processes hold the training model at TP=2 (then PP=2); each streams it into its own
NativeEngine at rollout TP 1. In the same processes, in alternation with the handoffs, a memcpy of
the same number of bytes is timed: `dst.copy_(src)` into a buffer allocated (and touched) once, as the
handoff copies into the engine's existing parameters (a fresh destination per call would pay page
faults the handoff does not); the ratio of the medians is the handoff's share of memcpy bandwidth.
The handoff runs as the trainer runs it (rollout.verify_weights=fingerprint: the engine fingerprints
what it stored, the sender what it sent) and without verification. In a separate, metered handoff
per cell the peak extra memory (HandoffReport.peak_extra_bytes, LiveTensorMeter) is compared, in
bytes, with the bound the stream promises (HandoffReport.peak_bound_bytes: one bucket + largest
tensor + what the check allocates).

    .venv/bin/python benchmarks/bench_reshard.py [--reps 3] [--models small,medium] [--no-write]
"""
from __future__ import annotations

import argparse

import benchlib as bl

LAYOUTS = ((2, 1), (1, 2))  # (tp, pp) of the training model, world 2
BUCKETS_MB = (2, 64)
VERIFY = ("fingerprint", "off")
MODELS = {"small": {},  # the bench model, ~10 MB fp32
          "medium": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, vocab_size=8192)}


def reinit_parallel(tp: int, pp: int):
    """Fresh megatron parallel_state with a new (tp, pp) layout inside one launch."""
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.distributed import init_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return init_model_parallel(tp, pp)


def _memcpy_seconds(src, dst) -> float:
    seconds, _ = bl.timed(dst.copy_, src)
    return seconds


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
    buf = torch.empty(max(sizes.values()), dtype=next(iter(local.values())).dtype)
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


def body(folder: str, reps: int) -> dict:
    """Per rank: {(tp, pp, bucket_mb, verify): {"handoff": [s], "memcpy": [s], "report": last, "metered": report}}."""
    import torch

    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.placement.reshard import update_engine_weights
    from hybridrl.rollout.native import NativeEngine

    out = {}
    for tp, pp in LAYOUTS:
        groups = reinit_parallel(tp, pp)
        model, spec = model_from_hf(folder, groups)
        engine = NativeEngine(spec, 1)
        warm = update_engine_weights(engine, model, spec, groups, BUCKETS_MB[-1], share=False)
        src, dst = torch.ones(warm.total_bytes, dtype=torch.uint8), torch.zeros(warm.total_bytes, dtype=torch.uint8)
        _memcpy_seconds(src, dst)  # both buffers paged in before any timing
        for _ in range(reps):
            for bucket_mb in BUCKETS_MB:
                for verify in VERIFY:
                    cell = out.setdefault((tp, pp, bucket_mb, verify),
                                          {"handoff": [], "memcpy": [], "transport": [], "samples": []})
                    cell["samples"].append(bl.sample())
                    report = update_engine_weights(engine, model, spec, groups, bucket_mb, verify=verify, share=False)  # A
                    cell["memcpy"].append(_memcpy_seconds(src, dst))  # B, same bytes, same process
                    cell["transport"].append(_transport_seconds(model, spec, groups))  # C
                    cell["handoff"].append(report.seconds)
                    cell["report"] = report
        for bucket_mb in BUCKETS_MB:  # memory, metered apart: the meter sees every op and slows the stream
            out[tp, pp, bucket_mb, VERIFY[0]]["metered"] = update_engine_weights(
                engine, model, spec, groups, bucket_mb, measure_memory=True, share=False)
        del model, engine, src, dst
    return out


def _rows(name: str, res: dict):
    speed, memory = [], []
    for (tp, pp, bucket_mb, verify), cell in res.items():
        r = cell["report"]
        hand, copy, wire = bl.median(cell["handoff"]), bl.median(cell["memcpy"]), bl.median(cell["transport"])
        layout = f"TP={tp}" if tp > 1 else f"PP={pp}"
        speed.append([name, f"{r.total_bytes / 2**20:.1f}", layout, bucket_mb, verify,
                      f"{r.total_bytes / hand / 2**30:.2f}", f"{r.total_bytes / copy / 2**30:.2f}",
                      f"**{100 * copy / hand:.1f}%**", f"{100 * copy / wire:.1f}%"] + bl.stamp(cell["samples"]))
        if "metered" in cell:
            m = cell["metered"]
            old_bound = max(m.bucket_bytes, m.max_bucket_bytes) + m.largest_tensor_bytes
            over = m.peak_extra_bytes - m.peak_bound_bytes
            memory.append([name, layout, bucket_mb, m.num_buckets, f"{m.peak_extra_bytes:,}", f"{old_bound:,}",
                           f"{m.verify_bytes:,}", f"{m.peak_bound_bytes:,}",
                           f"{m.peak_extra_bytes / m.peak_bound_bytes:.4f}",
                           "met" if over <= 0 else f"**missed by {over:,} B**"] + bl.stamp(cell["samples"]))
    return speed, memory


def report(results: dict, reps: int) -> tuple:
    """(section text, Summary rows)."""
    speed, memory = [], []
    for name, res in results.items():
        s, m = _rows(name, res)
        speed += s
        memory += m
    pct = lambda row: float(row[7].strip("*%"))  # noqa: E731
    verified = [r for r in speed if r[4] == VERIFY[0]]
    target = [r for r in verified if r[3] == 64]
    worst, best = min(target, key=pct), max(verified, key=pct)
    wire = [float(r[8].strip("%")) for r in target]
    missed = [r for r in memory if r[9] != "met"]
    over_old = [r for r in memory if int(r[4].replace(",", "")) > int(r[5].replace(",", ""))]
    speed_verdict = "met" if pct(worst) >= 50 else f"missed by {50 / pct(worst):.1f}x"
    memory_verdict = (f"met in all {len(memory)} cells" if not missed else
                      f"missed in {len(missed)} of {len(memory)} cells ("
                      + ", ".join(f"{r[0]} {r[1]} {r[2]} MiB" for r in missed) + ")")
    text = (f"## Reshard: weight handoff vs memcpy\n\n"
            f"Training layout world 2 -> NativeEngine at rollout TP 1 on each rank, fp32, 1 thread per rank, "
            f"medians of {reps} alternating reps (handoff A; memcpy B: `dst.copy_(src)` of the same bytes into a "
            f"buffer allocated and paged in once; the layout's gloo collectives alone C: `_transport_seconds`, "
            f"the floor of any handoff over gloo here). GiB/s per rank; `load 1-min` is the range over the cell's "
            f"reps.\n\n"
            + bl.table(["model", "MiB sent", "training", "bucket MiB", "verify", "handoff GiB/s",
                        "memcpy GiB/s", "handoff / memcpy", "collectives alone / memcpy"] + bl.STAMP_HEADER, speed)
            + f"\n\nTarget handoff >= 50% of memcpy with the default verification (fingerprint), 64 MiB buckets, "
            f"both models, TP 2 -> 1 and PP 2 -> 1: worst {pct(worst):.1f}% ({worst[0]}, {worst[2]}; "
            f"{speed_verdict}); best verified cell {pct(best):.1f}% ({best[0]}, {best[2]}, {best[3]} MiB).\n\n"
            f"Peak extra memory of one metered, verified handoff (HandoffReport.peak_extra_bytes, bytes) vs the bound "
            f"the stream promises (peak_bound_bytes = one bucket + largest tensor + what the fingerprint check "
            f"allocates, `reshard.verify_bytes`):\n\n"
            + bl.table(["model", "training", "bucket MiB", "buckets", "peak B", "bucket + largest B",
                        "check's allowance B", "bound B", "peak / bound", "verdict"] + bl.STAMP_HEADER, memory)
            + f"\n\nPeak <= bound: {memory_verdict}. Above one bucket + largest tensor alone (the bound as "
            f"stated before it counted the check): "
            + (", ".join(f"{r[0]} {r[1]} {r[2]} MiB ({r[4]} > {r[5]})" for r in over_old) or "none") + ".")
    summary = [["reshard >= 50% of memcpy (fingerprint, 64 MiB buckets)",
                f"worst **{pct(worst):.1f}%** ({worst[0]} {worst[2]}), best verified {pct(best):.1f}%; "
                f"collectives alone {min(wire):.0f}-{max(wire):.0f}% of memcpy",
                speed_verdict] + bl.stamp([x for res in results.values() for c in res.values() for x in c["samples"]]),
               ["reshard peak <= its bound (bytes)",
                f"{len(memory) - len(missed)} of {len(memory)} cells within; "
                f"worst peak / bound {max(float(r[8]) for r in memory):.4f}",
                memory_verdict] + bl.stamp([x for res in results.values() for c in res.values() for x in c["samples"]])]
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
