"""Command line of scripts/train_ppo.py (and train_rm.py): arguments, config loading, clean failure messages.

A ConfigError (or any hybridrl user error, see `hybridrl.log.run_cli`) ends the process with one
message and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from hybridrl.log import run_cli
from hybridrl.parallel.distributed import die_with_parent_if_spawned

die_with_parent_if_spawned()  # a spawned helper (async checkpoint writer) imports this module as it starts


def parse_args(argv):
    p = argparse.ArgumentParser(prog="train_ppo.py", description="PPO/GRPO post-training on megatron-core")
    p.add_argument("--config", default="configs/tiny_cpu.yaml", help="YAML config file")
    p.add_argument("--dry-run", action="store_true", help="run the whole flow once without updating, then stop")
    p.add_argument("--profile", action="store_true", help="print tokens/s per stage for every step")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    return p.parse_args(argv)


# megatron-core's notices about optional GPU extras, repeated per module on every rank.
QUIET = (r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed.*", r".*full scope is deprecated.*",
         r".*CUDA_DEVICE_MAX_CONNECTIONS.*")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def train(cfg):
        from hybridrl.trainer.loop import main_loop

        return main_loop(cfg, dry_run=args.dry_run, profile=args.profile)

    return run_with_config(args, train)


def run_with_config(args, body) -> int:
    """Load the config of parsed `args` (--config + overrides) and run `body(cfg)`; a user error
    prints one `error: ...` line and gives exit code 2 (shared by train_ppo.py and train_rm.py)."""
    for pattern in QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    from hybridrl.config.io import load_config

    return run_cli(lambda: finished(body(load_config(args.config, args.overrides))))


def finished(code: int) -> int:
    """`code`, after tearing down the process groups of a run that ended normally. Left to the interpreter's
    exit, they are destroyed while it dismantles itself, with their threads still running: a rank can abort
    there ("terminate called without an active exception") after its run succeeded, and NCCL warns on every
    rank. A run that failed keeps them: a peer that hangs would hold the teardown."""
    from hybridrl.parallel.distributed import destroy

    destroy()
    return code
