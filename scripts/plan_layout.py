#!/usr/bin/env python
"""Print the process groups and per-GPU memory estimate of a config on N nodes x G GPUs.

    python scripts/plan_layout.py --config configs/qwen2_7b.yaml --nodes 2 [--gpus-per-node 8] [key=value ...]
    python scripts/plan_layout.py --config configs/qwen2_7b.yaml --nodes 4 --placement auto [--staleness 1]
        [--profile-json metrics.json --profile-world 16]

With --placement auto it predicts the step time of the colocated layout and of every split of the
devices into rollout / actor / critic groups (hybridrl.planner.placement), from the phase costs of a
profile run (timing_s/* at --profile-world devices) or from the planner's FLOP and bandwidth model,
and prints the best split beside colocated with the overrides that select it.
Exit code 0 when the layout fits, 2 (with the fix in the message) when it cannot run.
Runs on a laptop: no GPU, no process groups, no model weights (placeholder model paths are fine).
"""
import argparse
import sys

from hybridrl.log import run_cli


def parse_args(argv):
    p = argparse.ArgumentParser(prog="plan_layout.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default: parallel.gpus_per_node)")
    p.add_argument("--vocab-size", type=int, default=0, help="tokenizer size when model.vocab_size is 0")
    p.add_argument("--placement", choices=("colocated", "auto"), default="colocated",
                   help="colocated: the memory plan of the config's layout; auto: the fastest placement of the roles")
    p.add_argument("--profile-json", default="", help="timing_s/* of a colocated run (JSON, list or lines)")
    p.add_argument("--profile-world", type=int, default=0, help="devices of the profile run (default: this world)")
    p.add_argument("--staleness", type=int, default=None,
                   help="0 synchronous, 1 one-step off-policy (default: async_training.staleness_threshold, else 0)")
    p.add_argument("--top", type=int, default=5, help="candidates listed with --placement auto")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=4")
    return p.parse_args(argv)


def _side_by_side(colocated, split) -> str:
    def column(c):
        if c is None:
            return ["no split fits", "", "", "", ""]
        util = "all phases in turn" if c.mode == "colocated" else ", ".join(
            f"{r} {100 * u:.0f}%" for r, u in c.utilisation.items())
        train, critic = c.group("colocated") or c.group("actor"), c.group("critic")
        rollout = c.group("rollout")
        return [f"{c.step_s:.2f} s/step{'' if c.fits else ' (DOES NOT FIT)'}",
                f"{'all' if c.mode == 'colocated' else rollout.devices} GPUs, tp{rollout.tp}",
                f"{train.devices} GPUs, tp{train.tp} pp{train.pp}",
                f"{critic.devices} GPUs, tp{critic.tp} pp{critic.pp}" if critic else "with the actor",
                util]

    names = ["predicted step", "rollout", "actor", "critic", "utilisation"]
    rows = [f"  {'':<15} {'colocated':<34} best split"]
    rows += [f"  {n:<15} {a:<34} {b}" for n, a, b in zip(names, column(colocated), column(split))]
    return "\n".join(rows)


def auto_placement(cfg, args, world: int, gpus: int) -> int:
    from hybridrl.planner import placement as pl

    staleness = args.staleness
    if staleness is None:  # async_training is being added to the config tree; read it when there
        staleness = getattr(getattr(cfg, "async_training", None), "staleness_threshold", 0)
    eff = pl.Efficiency()
    model = pl.PhaseCosts.from_config(cfg, world, args.vocab_size)
    if args.profile_json:
        pw = args.profile_world or world
        costs = pl.PhaseCosts.from_profile(
            pl.load_profile(args.profile_json), pw, eff(cfg.parallel.tensor_model_parallel_size,
                                                        cfg.parallel.pipeline_model_parallel_size),
            eff(cfg.rollout.tensor_model_parallel_size), model.gen_floor_s)
        source = f"profile {args.profile_json} at {pw} GPUs"
    else:
        costs, source = model, "FLOP/bandwidth model (400 TFLOP/s training, 3 TB/s HBM, full-length sequences)"
    cands = pl.place(costs, world, gpus, staleness, pl.config_memory_fits(cfg, args.vocab_size),
                     rollout_tp=cfg.rollout.tensor_model_parallel_size, efficiency=eff)
    colocated = next(c for c in cands if c.mode == "colocated")
    split = next((c for c in cands if c.mode == "split"), None)
    print(f"placement of {world} GPUs ({args.nodes} node(s) x {gpus}), staleness {staleness}; costs from {source}")
    print("phase costs, single-GPU seconds: " + ", ".join(
        f"{k} {getattr(costs, k):.1f}" for k in ("gen",) + pl.TRAIN_PHASES + ("switch",))
          + f"; weight sync {costs.update_weights:.2f} s, generation floor {costs.gen_floor_s:.2f} s")
    print(_side_by_side(colocated, split))
    print(f"top {args.top}:")
    print(pl.render(cands, args.top))
    best = cands[0]
    if split is not None:
        ratio = colocated.step_s / split.step_s
        print(f"best split: {ratio:.2f}x colocated's speed ({split.step_s:.2f} vs {colocated.step_s:.2f} s/step); "
              f"its overrides:")
        print("  " + " ".join(split.overrides()))
    print(f"predicted best: {best.mode}: " + " ".join(best.overrides()))
    return 0 if best.fits else 2


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_cli(plan_or_place, args)


def plan_or_place(args) -> int:
    from hybridrl.config.io import load_config
    from hybridrl.planner.plan import PlanError, estimate, plan

    cfg = load_config(args.config, args.overrides)
    gpus = args.gpus_per_node or cfg.parallel.gpus_per_node
    world = args.nodes * gpus
    if args.placement == "auto":
        return auto_placement(cfg, args, world, gpus)
    try:
        print(plan(cfg, world, args.vocab_size, gpus).render())
    except PlanError:
        print(estimate(cfg, world, args.vocab_size, gpus).render())  # what does not fit, then the error line
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
