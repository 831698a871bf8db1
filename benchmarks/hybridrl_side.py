"""hybridrl side of the benchmarks against TRL: the trainer on tiny_cpu.yaml + overrides, 2 threads.

    python benchmarks/hybridrl_side.py key=value ...

One process, world 1 (set MASTER_PORT to a free port). The orchestrator reads timing_s/* back
from the TensorBoard files under trainer.log_dir.
"""
import os
import sys

import torch

torch.set_num_threads(2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    from hybridrl.config_io import load_config
    from hybridrl.trainer_loop import main_loop

    sys.exit(main_loop(load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), sys.argv[1:])))
