"""Micro-batching of one update pass on variable-length rows: fixed row chunks at the batch's full
width (hybridrl before token budgets), the same chunks trimmed to their real columns, verl 0.9.1's
Karmarkar-Karp partition (as many micro-batches, trimmed the same way), and hybridrl's token budget
(`actor.use_dynamic_bsz`, sorted packing). Forward + backward of the bench model through megatron's
schedule, 1 process, 2 threads, timed in alternation; the peer is the fixed full-width split.

    python benchmarks/bench_micro_batches.py [--reps 3] [--budget 4096] [--verl-python PATH]

Rows: 16 prompts x 4 samples, prompts of 20-120 tokens, responses log-normal (median 90, capped at
256), the shape of a GRPO batch; verl's partition comes from its own function run in a python with
verl 0.9.1: --verl-python, else $VERL_PYTHON, else the checkout's .venv-verl when present
(`python3 -m venv .venv-verl && .venv-verl/bin/pip install verl==0.9.1`); without one the verl row is
left out, with a note saying so.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess

import benchlib as bl

P, R, ROWS, FIXED_ROWS = 120, 256, 64, 8
VERL_CODE = ("import json, sys, torch; from verl.utils.seqlen_balancing import calculate_workload, "
             "get_seqlen_balanced_partitions as part; w, k = json.load(sys.stdin); "
             "print(json.dumps(part(calculate_workload(torch.tensor(w)).tolist(), k, equal_size=False)))")


def lengths(seed: int = 0):
    rng, p, r = random.Random(seed), [], []
    for _ in range(ROWS // 4):
        plen = rng.randint(20, P)
        for _ in range(4):
            p.append(plen)
            r.append(max(1, min(R, int(rng.lognormvariate(4.5, 0.8)))))
    return p, r


def find_verl_python(given: str | None) -> str | None:
    """--verl-python, $VERL_PYTHON or the checkout's .venv-verl; None when none of them imports verl."""
    for path in (given, os.environ.get("VERL_PYTHON"), os.path.join(bl.ROOT, ".venv-verl", "bin", "python")):
        if path and os.path.exists(path) and subprocess.run([path, "-c", "import verl"], capture_output=True).returncode == 0:
            return path
        if path and path == given:
            raise SystemExit(f"--verl-python {given}: no python with verl there")
    return None


def verl_partition(verl_python: str, widths, k: int):
    out = subprocess.run([verl_python, "-c", VERL_CODE], input=json.dumps([widths, k]), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def _mean_loss(output, micro_batch):
    return output.float().mean(), {}  # the cost measured is the model's, not the loss's


def body(reps: int, budget: int, kk_by_count: dict) -> dict:
    import time

    import torch

    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.config.batching import MicroBatching
    from hybridrl.workers.micro_batches import plan_micro_batches, split_rows

    torch.set_num_threads(2)
    groups = init_model_parallel(1, 1)
    model, _ = model_from_hf(bl.bench_model_folder(), groups)
    p, r = lengths()
    pmask = (torch.arange(P)[None] >= (P - torch.tensor(p))[:, None]).float()
    rmask = (torch.arange(R)[None] < torch.tensor(r)[:, None]).float()
    ids = torch.randint(3, 500, (ROWS, P + R)) * torch.cat([pmask, rmask], 1).long()
    batch = {"input_ids": ids, "attention_mask": torch.cat([pmask, rmask], 1), "response_mask": rmask}
    ours = plan_micro_batches(batch, MicroBatching(FIXED_ROWS, budget))
    fixed = plan_micro_batches(batch, MicroBatching(FIXED_ROWS))
    variants = {"fixed 8 rows, full width": [{k: v[i[0]:i[-1] + 1] for k, v in batch.items()} for i in fixed],
                "fixed 8 rows, trimmed": split_rows(batch, fixed)}
    if kk_by_count:
        variants["verl Karmarkar-Karp, trimmed"] = split_rows(batch, kk_by_count[len(ours)])
    variants[f"token budget {budget} (hybridrl)"] = split_rows(batch, ours)
    times, samples = {name: [] for name in variants}, {name: [] for name in variants}
    for _ in range(reps):
        for name, mbs in variants.items():
            samples[name].append(bl.sample())
            start = time.perf_counter()
            pipeline_forward(model, mbs, _mean_loss, forward_only=False)
            times[name].append(time.perf_counter() - start)
    return {name: {"s": bl.median(times[name]), "micro": len(mbs), "samples": samples[name],
                   "positions": sum(mb["input_ids"].numel() for mb in mbs),
                   "max_positions": max(mb["input_ids"].numel() for mb in mbs)} for name, mbs in variants.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--verl-python", default=None,
                    help="python with verl 0.9.1 (default: $VERL_PYTHON, else .venv-verl; none: no verl row)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from dist_helper import run_distributed

    from hybridrl.workers.micro_batches import token_budget_plan

    p, r = lengths()
    k = len(token_budget_plan(p, r, args.budget))
    verl_python = find_verl_python(args.verl_python)
    kk = {k: verl_partition(verl_python, [a + b for a, b in zip(p, r)], k)} if verl_python else {}
    res = run_distributed(body, 1, args.reps, args.budget, kk)[0]
    base = next(iter(res.values()))
    rows = [[name, v["micro"], f"{v['positions']:,}", f"{v['max_positions']:,}", f"{v['s']:.3f}",
             f"**{v['s'] / base['s']:.2f}x**"] + bl.stamp(v["samples"]) for name, v in res.items()]
    no_verl = ("" if verl_python else "\n\nverl's Karmarkar-Karp row is left out: no python with verl 0.9.1 was "
               "given (--verl-python, $VERL_PYTHON or .venv-verl).")
    text = (f"## Micro-batches: token budget vs fixed rows and verl's Karmarkar-Karp\n\n"
            f"One forward + backward of the bench model over {ROWS} rows (16 prompts x 4, prompt 20-{P}, response "
            f"median ~90 capped at {R}; {sum(p) + sum(r):,} real tokens), median of {args.reps} alternating reps, "
            f"1 process, 2 threads. Positions = rows x width summed over micro-batches (what is computed).\n\n"
            + bl.table(["split", "micro-batches", "positions", "largest micro-batch", "s", "vs fixed full width"]
                       + bl.STAMP_HEADER, rows) + no_verl
            + "\n\nverl's partition balances real-token workloads because verl packs rows without padding; with "
            "rows padded to each micro-batch's longest, grouping similar lengths (sorted packing) computes fewer "
            "positions at the same micro-batch count and bounds the largest micro-batch by the budget.")
    print(text)
    if not args.no_write:
        bl.write_section("micro_batches", text)


if __name__ == "__main__":
    main()
