"""hybridrl side of the benchmarks against TRL: the trainer on tiny_cpu.yaml + overrides, 2 threads.

    python benchmarks/hybridrl_side.py key=value ...
    python -m torch.distributed.run --nproc_per_node=2 benchmarks/hybridrl_side.py placement.mode=split ...

One process, world 1 (set MASTER_PORT to a free port), or one per rank under torchrun (split
placement, bench_split.py); torch threads per process: $OMP_NUM_THREADS (2 if unset). The
orchestrator reads timing_s/* back from the TensorBoard files under trainer.log_dir. With
BENCH_PROFILE_STAGE=<stage> set (a key of stage_profile.STAGES) the run profiles that stage and
prints the profile last, as "@@JSON{...}".
"""
import json
import os
import sys

import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    from hybridrl.config.io import load_config
    from hybridrl.trainer.loop import main_loop
    from stage_profile import StageProfile

    stage = os.environ.get("BENCH_PROFILE_STAGE")
    profiled = StageProfile(stage) if stage else None
    rc = main_loop(load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), sys.argv[1:]))
    if profiled is not None:
        print("@@JSON" + json.dumps(profiled.result()))
    sys.exit(rc)
