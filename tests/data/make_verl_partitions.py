"""Reference data for tests/test_micro_batches.py: verl 0.9.1's Karmarkar-Karp micro-batch partitions.

Run in the verl side venv: /work/venvs/verl/bin/python tests/data/make_verl_partitions.py
For a few GRPO-like batches (prompt and response lengths), stores verl's balanced partition into k
micro-batches (`get_seqlen_balanced_partitions` over `calculate_workload`, as `rearrange_micro_batches`
does) for every k, so the test can compare the padded positions computed at equal micro-batch counts.
"""
import json
import os
import random

import torch
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions


def batch(seed: int, prompts: int, n: int):
    rng = random.Random(seed)
    p, r = [], []
    for _ in range(prompts):
        plen = rng.randint(20, 120)
        for _ in range(n):  # n samples share the prompt; responses vary (lognormal, capped)
            p.append(plen)
            r.append(max(1, min(512, int(rng.lognormvariate(4.5, 0.8)))))
    return p, r


def main():
    cases = []
    for seed, prompts, n in ((0, 8, 4), (1, 16, 4), (2, 4, 8)):
        p, r = batch(seed, prompts, n)
        workloads = calculate_workload(torch.tensor([a + b for a, b in zip(p, r)])).tolist()
        parts = {k: get_seqlen_balanced_partitions(workloads, k, equal_size=False) for k in range(1, len(p) + 1)}
        cases.append({"prompt_len": p, "response_len": r, "partitions": parts})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_partitions.json")
    with open(path, "w") as f:
        json.dump({"verl": "0.9.1", "cases": cases}, f)


if __name__ == "__main__":
    main()
