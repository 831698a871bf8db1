"""Offline checkpoint conversion between HF (safetensors) and hybridrl's megatron folder format.

  python scripts/convert_checkpoint.py hf-to-mcore --input HF_DIR --output MCORE_DIR --tp 2 --pp 2
  python scripts/convert_checkpoint.py mcore-to-hf --input MCORE_DIR --output HF_DIR
  torchrun --nproc_per_node=4 scripts/convert_checkpoint.py hf-to-mcore ...   (rank files in parallel)

The megatron folder holds one mp_rank_{tp:02d}_{pp:03d}/model.pt per rank and spec.json. Conversion
uses the pure mapping only: no model is built and no process group is started, so world size 1
converts every rank; under torchrun each process writes its share (mcore-to-hf runs on rank 0).
"""
from __future__ import annotations

import argparse
import os
import sys

from hybridrl.models.mcore_checkpoint import hf_folder_to_mcore, mcore_folder_to_hf


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("--input", required=True, help="source folder")
    p.add_argument("--output", required=True, help="destination folder (created)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the megatron shards (hf-to-mcore)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the megatron shards (hf-to-mcore)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.direction == "hf-to-mcore":
        spec = hf_folder_to_mcore(args.input, args.output, args.tp, args.pp, rank, world)
        if rank == 0:
            print(f"wrote tp={args.tp} pp={args.pp} shards of a {spec.num_layers}-layer model to {args.output}")
    elif rank == 0:
        mcore_folder_to_hf(args.input, args.output)
        print(f"wrote HF checkpoint to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
