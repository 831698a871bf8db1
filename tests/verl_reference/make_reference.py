"""Write verl_0_9_1.json: verl 0.9.1's own outputs on random inputs, the reference of test_verl_parity.py.

Run in the side venv that has verl (never a dependency of hybridrl):
    /work/venvs/verl/bin/python tests/verl_reference/make_reference.py
Inputs are drawn here with fixed seeds and stored next to verl's outputs, so the test reads both
and needs neither verl nor this script. Covered: core_algos.agg_loss (every mode, with and without
loss_scale_factor, fully masked rows), compute_policy_loss_vanilla / _gspo (loss, metrics and the
gradient with respect to log_prob), GRPO advantages with and without std normalisation (Dr. GRPO),
reward_score.gsm8k (strict and flexible), the DAPO reward manager's overlong penalty, and
metric_utils.process_validation_metrics (mean@N, best@N, worst@N, maj@N with its bootstrap).
"""
from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch

import verl
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.metric_utils import process_validation_metrics
from verl.utils.reward_score import gsm8k
from verl.workers.config import ActorConfig
from verl.workers.reward_manager.dapo import DAPORewardManager

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_0_9_1.json")
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _lists(t: torch.Tensor):
    return t.detach().double().tolist()


def _masks(g: torch.Generator, b: int, t: int) -> torch.Tensor:
    """Right-padded masks with lengths 0..t, at least one fully masked row."""
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[1] = 0
    return (torch.arange(t)[None] < lengths[:, None]).float()


def agg_loss_cases():
    g = torch.Generator().manual_seed(11)
    cases = []
    for b, t in ((6, 9), (5, 16), (3, 4)):
        loss = torch.randn(b, t, generator=g) * 3
        mask = _masks(g, b, t)
        for mode in MODES:
            for scale in (None, 7):
                out = core_algos.agg_loss(loss, mask, mode, loss_scale_factor=scale)
                cases.append({"loss_mat": _lists(loss), "mask": _lists(mask), "mode": mode,
                              "loss_scale_factor": scale, "expect": float(out)})
    return cases


def policy_loss_cases():
    g = torch.Generator().manual_seed(12)
    cases = []
    for loss_mode, low, high in (("vanilla", 0.2, 0.28), ("gspo", 3e-4, 4e-4), ("gspo", 0.2, 0.2)):
        for mode in MODES:
            b, t = 6, 10
            mask = _masks(g, b, t)
            mask[1, :3] = 1.0  # GSPO needs tokens in every row for its sequence ratio to matter
            old = -2.0 + 0.5 * torch.randn(b, t, generator=g)
            # log-ratios up to ~0.4 (vanilla) reach both clip edges; small ones stay inside GSPO's range
            spread = 0.3 if loss_mode == "vanilla" or low > 0.01 else 1e-3
            new = old + spread * torch.randn(b, t, generator=g)
            adv = (torch.randn(b, 1, generator=g) * torch.ones(1, t)) * mask
            if loss_mode == "vanilla":  # ratios above clip_ratio_c with negative advantages: the dual clip
                new[:, :2] += 1.5 * (adv[:, :2] < 0)
            new.requires_grad_(True)
            cfg = ActorConfig(strategy="megatron", clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high,
                              clip_ratio_c=3.0, loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                              ppo_mini_batch_size=1, policy_loss={"loss_mode": loss_mode})
            fn = core_algos.get_policy_loss_fn(loss_mode)
            loss, metrics = fn(old, new, adv, mask, loss_agg_mode=mode, config=cfg)
            (grad,) = torch.autograd.grad(loss, new)
            cases.append({"loss_mode": loss_mode, "agg_mode": mode, "clip_low": low, "clip_high": high,
                          "old_log_prob": _lists(old), "log_prob": _lists(new), "advantages": _lists(adv),
                          "mask": _lists(mask), "loss": float(loss.detach()), "grad": _lists(grad),
                          "metrics": {k: float(v) for k, v in metrics.items()}})
    return cases


def grpo_cases():
    g = torch.Generator().manual_seed(13)
    cases = []
    for norm in (True, False):
        b, t = 12, 5
        mask = _masks(g, b, t)
        mask[1, 0] = 1.0
        scores = torch.randint(0, 3, (b,), generator=g).float()
        rewards = torch.zeros(b, t)
        rewards[torch.arange(b), (mask.sum(-1).long() - 1).clamp(min=0)] = scores
        index = np.array([i // 3 for i in range(b - 1)] + [99])  # four groups of 3 (one with 2) and a singleton
        adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
        cases.append({"scores": _lists(scores), "mask": _lists(mask), "index": index.tolist(),
                      "norm_by_std": norm, "advantages": _lists(adv)})
    return cases


def gsm8k_cases():
    rng = random.Random(14)
    numbers = ["72", "1,000", "1,234.5", "-3", "2.5", "$18", "72.", ".", ",", "0", "007", "1000", "12,3"]
    templates = ["#### {a}", "so the answer is {a}", "#### {a}.", "{b} apples and {a} pears\n#### {a}",
                 "####{a}", "#### ${a}", "the total is {a}. #### {b}", "{a}", "no number here.",
                 "Hello, world", "x" * 310 + "#### {a}", "#### {a}" + "y" * 300, "{b}, then {a},",
                 "#### -{a}", "answer: {a}!"]
    cases = []
    for _ in range(120):
        a, b = rng.choice(numbers), rng.choice(numbers)
        text = rng.choice(templates).format(a=a, b=b)
        truth = rng.choice([a.replace(",", "").replace("$", ""), a, b, "72", "1000"])
        for method in ("strict", "flexible"):
            cases.append({"text": text, "ground_truth": truth, "method": method,
                          "answer": gsm8k.extract_solution(text, method),
                          "score": float(gsm8k.compute_score(text, truth, method=method))})
    return cases


class _IdsTokenizer:
    """decode(ids) -> space-separated ids: the overlong penalty only needs lengths."""
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def overlong_cases():
    g = torch.Generator().manual_seed(15)
    b, p, r = 10, 4, 16
    lengths = torch.tensor([1, 4, 8, 9, 11, 12, 13, 15, 16, 16])
    scores = torch.rand(b, generator=g).round()
    rmask = (torch.arange(r)[None] < lengths[:, None]).long()
    data = DataProto.from_dict(
        tensors={"prompts": torch.ones(b, p, dtype=torch.long), "responses": torch.ones(b, r, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(b, p, dtype=torch.long), rmask], 1)},
        non_tensors={"reward_model": np.array([{"ground_truth": float(s)} for s in scores], dtype=object),
                     "data_source": np.array(["x"] * b, dtype=object)})
    cases = []
    for buffer_len, factor in ((4, 1.0), (8, 0.5), (16, 2.0)):
        cfg = type("Buf", (), {"enable": True, "len": buffer_len, "penalty_factor": factor, "log": False})()
        manager = DAPORewardManager(_IdsTokenizer(), 0, compute_score=lambda **kw: kw["ground_truth"],
                                    max_resp_len=r, overlong_buffer_cfg=cfg)
        reward = manager(data).sum(-1)
        cases.append({"lengths": lengths.tolist(), "max_response_length": r, "len": buffer_len,
                      "penalty_factor": factor, "scores": _lists(scores), "rewards": _lists(reward)})
    return cases


def validation_cases():
    rng = np.random.RandomState(16)
    cases = []
    for n in (1, 3, 4, 5):
        sources, uids, reward, acc, pred = [], [], [], [], []
        for prompt in range(7):
            source = ["openai/gsm8k", "synthetic/arith"][prompt % 2]
            for _ in range(n):
                sources.append(source)
                uids.append(f"p{prompt}")
                answer = int(rng.randint(0, 3))
                pred.append(str(answer))
                acc.append(float(answer == 1))
                reward.append(round(float(rng.rand()), 3))
        infos = {"reward": reward, "acc": acc, "pred": pred}
        out = process_validation_metrics(sources, uids, infos)
        cases.append({"data_sources": sources, "uids": uids, "infos": infos,
                      "expect": {s: {v: dict(m) for v, m in vm.items()} for s, vm in out.items()}})
    return cases


def main():
    ref = {"verl_version": verl.__version__, "torch_version": torch.__version__,
           "numpy_version": np.__version__, "agg_loss": agg_loss_cases(), "policy_loss": policy_loss_cases(),
           "grpo": grpo_cases(), "gsm8k": gsm8k_cases(), "overlong": overlong_cases(),
           "validation": validation_cases()}
    with open(OUT, "w") as f:
        json.dump(ref, f, indent=0)
        f.write("\n")
    print(f"wrote {OUT} (verl {verl.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
