#!/usr/bin/env python
"""Print the process groups and per-GPU memory estimate of a config on N nodes x G GPUs.

    python scripts/plan_layout.py --config configs/qwen2_7b.yaml --nodes 2 [--gpus-per-node 8] [key=value ...]

Exit code 0 when the layout fits, 2 (with the fix in the message) when it cannot run.
Runs on a laptop: no GPU, no process groups, no model weights (placeholder model paths are fine).
"""
import argparse
import sys

from hybridrl.config import ConfigError


def parse_args(argv):
    p = argparse.ArgumentParser(prog="plan_layout.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default: parallel.gpus_per_node)")
    p.add_argument("--vocab-size", type=int, default=0, help="tokenizer size when model.vocab_size is 0")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=4")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from hybridrl.config_io import load_config
    from hybridrl.planner import PlanError, estimate, plan

    try:
        cfg = load_config(args.config, args.overrides)
        gpus = args.gpus_per_node or cfg.parallel.gpus_per_node
        world = args.nodes * gpus
        try:
            print(plan(cfg, world, args.vocab_size, gpus).render())
        except PlanError as err:
            print(estimate(cfg, world, args.vocab_size, gpus).render())
            print(f"error: {err}", file=sys.stderr)
            return 2
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
