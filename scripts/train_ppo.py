#!/usr/bin/env python
"""Entry point: torchrun --nproc_per_node=N scripts/train_ppo.py --config configs/X.yaml [key=value ...]"""
import sys

from hybridrl.trainer.entry import main

if __name__ == "__main__":
    sys.exit(main())
