"""Command line of scripts/train_sft.py; user errors end in one `error: ...` line and exit code 2."""
from __future__ import annotations

import argparse
import sys
import warnings

from hybridrl.log import run_cli
from hybridrl.trainer.entry import QUIET, finished


def main(argv=None) -> int:
    for pattern in QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    p = argparse.ArgumentParser(prog="train_sft.py", description="SFT on chat trajectories (megatron-core)")
    p.add_argument("--config", default="configs/tiny_cpu_tools.yaml", help="YAML config file (same tree as RL)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.optim.lr=1e-5")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from hybridrl.config.io import load_config

    def train():
        cfg = load_config(args.config, args.overrides)
        from hybridrl.sft.trainer import run_sft

        return finished(run_sft(cfg))

    return run_cli(train)
