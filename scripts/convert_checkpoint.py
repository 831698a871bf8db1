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
the world size) and writes the HF folder from rank 0, after checking the actor's files against the sizes and
crc32s its meta.json lists. Bad input (a damaged checkpoint too) ends in one `error: ...` line, exit code 2.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from hybridrl.log import UsageError, run_cli
from hybridrl.models.mcore_checkpoint import hf_folder_to_mcore, mcore_folder_to_hf

# What --input must hold per direction (ckpt-to-hf checks its folder itself, naming what it found instead).
INPUT_FILE = {"hf-to-mcore": ("config.json", "an HF model folder (config.json + *.safetensors)"),
              "mcore-to-hf": ("spec.json", "a folder written by hf-to-mcore (spec.json + mp_rank_*/)")}


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


def check_input(args) -> None:
    """UsageError naming the fix when --input is not the kind of folder the direction reads."""
    if args.direction not in INPUT_FILE:
        return
    name, kind = INPUT_FILE[args.direction]
    if not os.path.isdir(args.input):
        raise UsageError(f"--input {args.input}: no such folder; pass {kind}")
    if not os.path.isfile(os.path.join(args.input, name)):
        raise UsageError(f"--input {args.input} has no {name}; pass {kind}")


def check_layout(args) -> None:
    """hf-to-mcore: UsageError naming the fix when --tp x --pp cannot split this model."""
    from hybridrl.models.hf_config import as_config_dict, check_parallel_layout, spec_from_hf_config

    spec = spec_from_hf_config(as_config_dict(args.input))  # an UnsupportedConfigError names the field
    try:
        check_parallel_layout(spec, args.tp, args.pp)
    except ValueError as err:
        raise UsageError(f"--tp {args.tp} --pp {args.pp} does not fit {args.input}: {err}") from None


def convert(args) -> int:
    check_input(args)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.direction == "hf-to-mcore":
        check_layout(args)
        spec = hf_folder_to_mcore(args.input, args.output, args.tp, args.pp, rank, world)
        if rank == 0:
            print(f"wrote tp={args.tp} pp={args.pp} shards of a {spec.num_layers}-layer model to {args.output}")
        return 0
    if args.direction == "ckpt-to-hf":
        _ckpt_to_hf(args)
    elif rank == 0:
        mcore_folder_to_hf(args.input, args.output)
    if rank == 0:
        print(f"wrote HF checkpoint to {args.output}")
    return 0


def main(argv=None) -> int:
    return run_cli(convert, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
