#!/usr/bin/env python
"""Generate from an HF model folder with the native engine (see hybridrl.rollout.generate_cli):

  torchrun --nproc_per_node=N scripts/generate.py --model HF_DIR --tensor-parallel-size T \
      --prompts-file prompts.jsonl --max-new-tokens K [--temperature 0] --output out.jsonl
"""
import sys

from hybridrl.rollout.generate_cli import main

if __name__ == "__main__":
    sys.exit(main())
