"""Reference data for GAE over loss masks with holes (multi-turn tool output), from verl 0.9.1 itself.

Run in the side venv that has verl (never a hybridrl dependency; requirements-verl.txt):
    make verl-reference        # creates .venv-verl, then runs make_reference.py and this script
It writes gae_holes_verl_0_9_1.json beside this file: inputs (rewards, values, masks, gamma, lam) and
verl's `compute_gae_advantage_return` outputs, float64. Rewards and values are nonzero inside the
holes too, so a GAE that reads them there (instead of carrying across) differs from the reference.
"""
import json
import os

import torch
import verl
from verl.trainer.ppo.core_algos import compute_gae_advantage_return

# 1 = model token, 0 = tool output or padding; rows are right-padded trajectories of width 12
MASKS = [
    [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0],   # call, tool result, answer, padding
    [1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1],   # two tool results, no padding
    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],   # single turn
    [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0],   # alternating holes of one token
    [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],   # leading hole
]
PARAMS = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)]


def main():
    g = torch.Generator().manual_seed(18)
    mask = torch.tensor(MASKS, dtype=torch.float64)
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    cases = []
    for gamma, lam in PARAMS:
        adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
        cases.append({"gamma": gamma, "lam": lam, "advantages": adv.tolist(), "returns": ret.tolist()})
    out = {"verl_version": verl.__version__, "function": "verl.trainer.ppo.core_algos.compute_gae_advantage_return",
           "response_mask": MASKS, "token_level_rewards": rewards.tolist(), "values": values.tolist(), "cases": cases}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gae_holes_verl_0_9_1.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
