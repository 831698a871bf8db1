#!/usr/bin/env python
"""SFT entry point: torchrun --nproc_per_node=N scripts/train_sft.py --config configs/X.yaml [key=value ...]"""
import sys

from hybridrl.sft.entry import main

if __name__ == "__main__":
    sys.exit(main())
