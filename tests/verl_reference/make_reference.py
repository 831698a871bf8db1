"""Write verl_0_9_1.json: verl 0.9.1's own outputs on random inputs, the reference of test_verl_parity.py.

Run in the side venv that has verl (never a dependency of hybridrl; requirements-verl.txt):
    make verl-reference        # creates .venv-verl, then runs this script, make_gae_holes.py and
                               # make_rollout_correction.py
Inputs are drawn here with fixed seeds and stored next to verl's outputs, so the test reads both
and needs neither verl nor this script. Covered: core_algos.agg_loss (every mode, with and without
loss_scale_factor, fully masked rows), compute_policy_loss_vanilla / _gspo (loss, metrics and the
gradient with respect to log_prob), GRPO advantages with and without std normalisation (Dr. GRPO),
RLOO, REINFORCE++ (over masks with holes: multi-turn tool output), REINFORCE++-baseline and ReMax
advantages, kl_penalty of every kind past its clamps, compute_value_loss (every mode, clip fraction,
gradient), the adaptive KL controller and ray_trainer.apply_kl_penalty (the reward, its metrics and the
controller's update by the batch's rows), reward_score.gsm8k (strict and flexible), the DAPO reward
manager's overlong penalty, and metric_utils.process_validation_metrics (mean@N, best@N, worst@N,
maj@N with its bootstrap).
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
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
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


def _outcome_rewards(g: torch.Generator, mask: torch.Tensor, values=(0.0, 1.0, 2.0)) -> torch.Tensor:
    """A score per row on its last valid token (rows without one get none)."""
    b, t = mask.shape
    scores = torch.tensor(values)[torch.randint(0, len(values), (b,), generator=g)]
    rewards = torch.zeros(b, t)
    has = mask.sum(-1) > 0
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rewards[torch.arange(b)[has], last[has]] = scores[has]
    return rewards


# right padding and holes (tool output inside a multi-turn trajectory), width 10
HOLE_MASKS = [[1, 1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
              [1, 0, 1, 0, 1, 0, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]]


def outcome_advantage_cases():
    """RLOO and REINFORCE++-baseline over groups (one singleton), from outcome rewards."""
    g = torch.Generator().manual_seed(20)
    cases = []
    estimators = {"rloo": core_algos.compute_rloo_outcome_advantage,
                  "reinforce_plus_plus_baseline": core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage}
    for name, fn in estimators.items():
        b, t = 13, 6
        mask = _masks(g, b, t)
        mask[1, 0] = 1.0
        rewards = _outcome_rewards(g, mask)
        index = np.array([i // 4 for i in range(b - 1)] + [99])  # three groups of 4 and a singleton
        adv, ret = fn(rewards.clone(), mask, index)
        cases.append({"estimator": name, "token_level_rewards": _lists(rewards), "mask": _lists(mask),
                      "index": index.tolist(), "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def reinforce_pp_cases():
    """REINFORCE++ over masks with holes: outcome rewards plus per-token terms on model tokens (KL in the
    reward), and rewards inside the holes too (which verl ignores)."""
    g = torch.Generator().manual_seed(21)
    mask = torch.tensor(HOLE_MASKS, dtype=torch.float32)
    cases = []
    for gamma in (1.0, 0.9):
        for in_holes in (False, True):
            rewards = _outcome_rewards(g, mask) + 0.1 * torch.randn(mask.shape, generator=g) * (
                1.0 if in_holes else mask)
            adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
                rewards.clone(), mask, config=AlgoConfig(gamma=gamma))
            cases.append({"gamma": gamma, "token_level_rewards": _lists(rewards), "mask": _lists(mask),
                          "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def remax_cases():
    g = torch.Generator().manual_seed(22)
    cases = []
    for b, t in ((6, 7), (4, 3)):
        mask = _masks(g, b, t)
        rewards = _outcome_rewards(g, mask) + 0.05 * torch.randn(b, t, generator=g) * mask
        baselines = torch.randint(0, 3, (b,), generator=g).float()
        adv, ret = core_algos.compute_remax_outcome_advantage(rewards, baselines, mask)
        cases.append({"token_level_rewards": _lists(rewards), "reward_baselines": _lists(baselines),
                      "mask": _lists(mask), "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def kl_penalty_cases():
    """Every kind on log-prob differences from tiny to far past the clamps (k3: |diff| > 20, result > 10)."""
    g = torch.Generator().manual_seed(23)
    logprob = -3.0 + torch.randn(4, 8, generator=g)
    ref = logprob + torch.cat([0.01 * torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g),
                               torch.tensor([[-30.0, 30.0, -21.0, 21.0, -12.0, 12.0, -5.0, 5.0]]),
                               torch.tensor([[-19.9, 19.9, 0.0, -1e-4, 1e-4, -11.5, 11.0, 2.0]])])
    return [{"kind": kind, "logprob": _lists(logprob), "ref_logprob": _lists(ref),
             "kl": _lists(core_algos.kl_penalty(logprob, ref, kind))}
            for kind in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")]


def value_loss_cases():
    g = torch.Generator().manual_seed(24)
    cases = []
    for mode in MODES:
        for clip in (0.2, 0.5):
            b, t = 6, 9
            mask = _masks(g, b, t)
            old = torch.randn(b, t, generator=g)
            vpreds = (old + 0.6 * torch.randn(b, t, generator=g)).requires_grad_(True)
            returns = torch.randn(b, t, generator=g)
            loss, clipfrac = core_algos.compute_value_loss(vpreds, returns, old, mask, clip, loss_agg_mode=mode)
            (grad,) = torch.autograd.grad(loss, vpreds)
            cases.append({"agg_mode": mode, "cliprange_value": clip, "vpreds": _lists(vpreds), "values": _lists(old),
                          "returns": _lists(returns), "mask": _lists(mask), "loss": float(loss.detach()),
                          "clipfrac": float(clipfrac), "grad": _lists(grad)})
    return cases


def kl_controller_cases():
    """The adaptive controller over a run of observed KLs (inside and past its +-20% clip), and
    ray_trainer.apply_kl_penalty: the penalised reward, its metrics and the update it makes (n_steps is
    the batch's rows, responses rather than prompts)."""
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.05, horizon=1000)
    observed = [0.05, 0.0, 0.3, 0.055, 0.045, 1e-4, 0.07, 0.01]
    values = []
    for i, kl in enumerate(observed):
        ctrl.update(current_kl=kl, n_steps=8 * (i + 1))
        values.append(float(ctrl.value))
    g = torch.Generator().manual_seed(25)
    b, t = 8, 5
    mask = _masks(g, b, t)
    scores = _outcome_rewards(g, mask)
    old = -2.0 + 0.5 * torch.randn(b, t, generator=g)
    ref = old + 0.3 * torch.randn(b, t, generator=g)
    penalty = []
    for kind in ("kl", "low_var_kl"):
        kl_ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=100)
        data = DataProto.from_dict(tensors={"response_mask": mask, "token_level_scores": scores,
                                            "old_log_probs": old, "ref_log_prob": ref})
        data, metrics = apply_kl_penalty(data, kl_ctrl, kl_penalty=kind)
        penalty.append({"kind": kind, "init_kl_coef": 0.1, "target_kl": 0.02, "horizon": 100,
                        "token_level_scores": _lists(scores), "old_log_probs": _lists(old), "ref_log_prob": _lists(ref),
                        "mask": _lists(mask), "token_level_rewards": _lists(data.batch["token_level_rewards"]),
                        "metrics": {k: float(v) for k, v in metrics.items()}, "coef_after": float(kl_ctrl.value)})
    return {"adaptive": {"init_kl_coef": 0.2, "target_kl": 0.05, "horizon": 1000, "observed": observed,
                         "n_steps": [8 * (i + 1) for i in range(len(observed))], "values": values},
            "apply_kl_penalty": penalty}


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
           "grpo": grpo_cases(), "outcome_advantages": outcome_advantage_cases(),
           "reinforce_plus_plus": reinforce_pp_cases(), "remax": remax_cases(), "kl_penalty": kl_penalty_cases(),
           "value_loss": value_loss_cases(), "kl_controller": kl_controller_cases(), "gsm8k": gsm8k_cases(),
           "overlong": overlong_cases(),
           "validation": validation_cases()}
    write_reference(OUT, ref)


def write_reference(path: str, ref: dict) -> None:
    with open(path, "w") as f:
        json.dump(ref, f, indent=0)
        f.write("\n")
    print(f"wrote {path} (verl {verl.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
