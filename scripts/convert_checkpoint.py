"""Offline checkpoint conversion: HF (safetensors) <-> hybridrl's megatron folder format, and a training
checkpoint's actor -> HF.

  python scripts/convert_checkpoint.py hf-to-mcore --input HF_DIR --output MCORE_DIR --tp 2 --pp 2
  python scripts/convert_checkpoint.py mcore-to-hf --input MCORE_DIR --output HF_DIR
  python scripts/convert_checkpoint.py ckpt-to-hf --input CKPT/global_step_K --output HF_DIR [--tp T --pp P]
  torchrun --nproc_per_node=4 scripts/convert_checkpoint.py hf-to-mcore|ckpt-to-hf ...

The megatron folder holds one mp_rank_{tp:02d}_{pp:03d}/model.pt per rank and spec.json; hf-to-mcore and
mcore-to-hf use the pure mapping only (no model, no process group), so world size 1 converts every rank
and under torchrun each process writes its share (mcore-to-hf runs on rank 0). ckpt-to-hf reads a
dist_checkpointing folder written at any layout into a model built at --tp x --pp (DP: the rest of
the world size) and writes the HF folder from rank 0.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from hybridrl.models.mcore_checkpoint import hf_folder_to_mcore, mcore_folder_to_hf


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf", "ckpt-to-hf"])
    p.add_argument("--input", required=True, help="source folder")
    p.add_argument("--output", required=True, help="destination folder (created)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the megatron shards / of the model")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the megatron shards / of the model")
    return p.parse_args(argv)


def _ckpt_to_hf(args) -> None:
    from hybridrl.checkpoint.to_hf import checkpoint_to_hf
    from hybridrl.parallel.distributed import destroy, init_distributed

    if "RANK" not in os.environ:  # one process: a free port instead of the fixed default
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    init_distributed()
    try:
        checkpoint_to_hf(args.input, args.output, args.tp, args.pp)
    finally:
        destroy()


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.direction == "hf-to-mcore":
        spec = hf_folder_to_mcore(args.input, args.output, args.tp, args.pp, rank, world)
        if rank == 0:
            print(f"wrote tp={args.tp} pp={args.pp} shards of a {spec.num_layers}-layer model to {args.output}")
        return 0
    if args.direction == "ckpt-to-hf":
        from hybridrl.trainer.entry import user_errors

        try:
            _ckpt_to_hf(args)
        except user_errors() as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    elif rank == 0:
        mcore_folder_to_hf(args.input, args.output)
    if rank == 0:
        print(f"wrote HF checkpoint to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
