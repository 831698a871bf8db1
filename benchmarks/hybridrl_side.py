"""hybridrl side of the benchmarks against TRL: the trainer on tiny_cpu.yaml + overrides, 2 threads.

    python benchmarks/hybridrl_side.py key=value ...
    python -m torch.distributed.run --nproc_per_node=2 benchmarks/hybridrl_side.py placement.mode=split ...

One process, world 1 (set MASTER_PORT to a free port), or one per rank under torchrun (split
placement, bench_split.py); torch threads per process: $OMP_NUM_THREADS (2 if unset). The
orchestrator reads timing_s/* back from the TensorBoard files under trainer.log_dir. Every garbage
collection (automatic or explicit, `gc.callbacks`) is recorded as (start, seconds) and printed at
the end as "@@GC[...]" (rank 0). With BENCH_PROFILE_STAGE=<stage> set (a key of
stage_profile.STAGES) the run profiles that stage and prints the profile last, as "@@JSON{...}".
"""
import gc
import json
import os
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record_gc(events: list) -> None:
    """Append (time.time() at its start, seconds) of every garbage collection to `events`."""
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started[:] = [time.time(), time.perf_counter()]
        elif started:
            events.append((started[0], time.perf_counter() - started[1]))
    gc.callbacks.append(on_gc)


if __name__ == "__main__":
    from hybridrl.config.io import load_config
    from hybridrl.trainer.loop import main_loop
    from stage_profile import StageProfile

    stage = os.environ.get("BENCH_PROFILE_STAGE")
    profiled = StageProfile(stage) if stage else None
    gc_events = []
    record_gc(gc_events)
    rc = main_loop(load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), sys.argv[1:]))
    if os.environ.get("RANK", "0") == "0":
        print("@@GC" + json.dumps(gc_events))
    if profiled is not None:
        print("@@JSON" + json.dumps(profiled.result()))
    sys.exit(rc)
