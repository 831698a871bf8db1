#!/usr/bin/env python
"""Reward model: torchrun --nproc_per_node=N scripts/train_rm.py --config configs/tiny_cpu_rm.yaml [key=value ...]"""
import sys

from hybridrl.reward_model.training import main

if __name__ == "__main__":
    sys.exit(main())
