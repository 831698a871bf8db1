"""Write more_algos_verl_0_9_1.json: verl 0.9.1's own outputs for the algorithms added after verl_0_9_1.json was
written, the reference of the tests at the end of tests/test_verl_parity.py.

Run in the side venv that has verl (`make verl-reference`). Inputs are drawn here with fixed seeds and stored
beside verl's outputs. Covered: core_algos.agg_loss "token-sum"; the cispo, gpg and dro policy losses (loss,
metrics and the gradient with respect to log_prob, every aggregation); the grpo_passk (with and without std
normalisation, tied best scores included), opo and gpg advantage estimators; kl_penalty's straight-through
"+" kinds (value and gradient); the geo_mean, clip_cov and kl_cov policy losses.
"""
from __future__ import annotations

import os

import numpy as np
import torch

import verl
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig

from make_reference import _lists, _masks, _outcome_rewards, write_reference

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "more_algos_verl_0_9_1.json")
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def token_sum_cases():
    g = torch.Generator().manual_seed(31)
    cases = []
    for b, t in ((6, 9), (3, 4)):
        loss, mask = torch.randn(b, t, generator=g) * 3, _masks(g, b, t)
        cases.append({"loss_mat": _lists(loss), "mask": _lists(mask),
                      "expect": float(core_algos.agg_loss(loss, mask, "token-sum"))})
    return cases


def policy_loss_cases():
    g = torch.Generator().manual_seed(32)
    cases = []
    for loss_mode in ("cispo", "gpg", "dro"):
        for mode in MODES:
            b, t = 6, 10
            mask = _masks(g, b, t)
            old = -2.0 + 0.5 * torch.randn(b, t, generator=g)
            new = (old + 0.3 * torch.randn(b, t, generator=g)).requires_grad_(True)  # ratios past both clip edges
            adv = (torch.randn(b, 1, generator=g) * torch.ones(1, t)) * mask
            cfg = ActorConfig(strategy="megatron", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                              loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1,
                              policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.5))
            loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(old, new, adv, mask, loss_agg_mode=mode, config=cfg)
            (grad,) = torch.autograd.grad(loss, new)
            cases.append({"loss_mode": loss_mode, "agg_mode": mode, "clip_low": 0.2, "clip_high": 0.28, "dro_beta": 0.5,
                          "old_log_prob": _lists(old), "log_prob": _lists(new.detach()), "advantages": _lists(adv),
                          "mask": _lists(mask), "loss": float(loss.detach()), "grad": _lists(grad),
                          "metrics": {k: float(v) for k, v in metrics.items()}})
    return cases


def covariance_loss_cases():
    """geo_mean (GMPO), clip_cov (torch.manual_seed(seed) right before each call: it draws with torch.randperm)
    and kl_cov, with shares and bounds large enough that several tokens are picked."""
    g = torch.Generator().manual_seed(35)
    cases = []
    for loss_mode in ("geo_mean", "clip_cov", "kl_cov"):
        for mode in ("token-mean", "seq-mean-token-sum"):
            b, t = 6, 10
            mask = _masks(g, b, t)
            old = -2.0 + 0.5 * torch.randn(b, t, generator=g)
            new = (old + 0.3 * torch.randn(b, t, generator=g)).requires_grad_(True)
            adv = (3 * torch.randn(b, 1, generator=g) * torch.ones(1, t)) * mask
            cfg = ActorConfig(strategy="megatron", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                              loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1,
                              policy_loss=PolicyLossConfig(loss_mode=loss_mode, clip_cov_ratio=0.2, clip_cov_lb=0.5,
                                                           clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.3))
            seed = len(cases)
            torch.manual_seed(seed)
            loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(old, new, adv, mask, loss_agg_mode=mode, config=cfg)
            (grad,) = torch.autograd.grad(loss, new)
            cases.append({"loss_mode": loss_mode, "agg_mode": mode, "seed": seed, "clip_low": 0.2, "clip_high": 0.28,
                          "cov_ratio": 0.2, "cov_lb": 0.5, "cov_ub": 5.0, "kl_coef": 0.3,
                          "old_log_prob": _lists(old), "log_prob": _lists(new.detach()), "advantages": _lists(adv),
                          "mask": _lists(mask), "loss": float(loss.detach()), "grad": _lists(grad),
                          "metrics": {k: float(v) for k, v in metrics.items()}})
    return cases


def estimator_cases():
    g = torch.Generator().manual_seed(33)
    cases = []
    runs = [("grpo_passk", {"norm_adv_by_std_in_grpo": True}), ("grpo_passk", {"norm_adv_by_std_in_grpo": False}),
            ("opo", {}), ("gpg", {})]
    for name, options in runs:
        b, t = 16, 6
        mask = _masks(g, b, t)
        mask[1, 0] = 1.0
        rewards = _outcome_rewards(g, mask, values=(0.0, 1.0, 1.0, 2.5))  # repeated values: tied best scores
        index = np.array([i // 4 for i in range(b)])  # four groups of 4
        if name != "grpo_passk":
            index[-1] = 99  # and a singleton
        fn = core_algos.get_adv_estimator_fn(name)
        adv, ret = fn(token_level_rewards=rewards.clone(), response_mask=mask, index=index,
                      config=AlgoConfig(**options))
        cases.append({"estimator": name, "norm_by_std": options.get("norm_adv_by_std_in_grpo", True),
                      "token_level_rewards": _lists(rewards), "mask": _lists(mask), "index": index.tolist(),
                      "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def straight_through_kl_cases():
    g = torch.Generator().manual_seed(34)
    logprob = -3.0 + torch.randn(3, 8, generator=g)
    ref = logprob + torch.cat([0.01 * torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g),
                               torch.tensor([[-30.0, 30.0, -21.0, 21.0, -12.0, 12.0, -5.0, 5.0]])])
    cases = []
    for kind in ("kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"):
        x = logprob.clone().requires_grad_(True)
        kl = core_algos.kl_penalty(x, ref, kind)
        (grad,) = torch.autograd.grad(kl.sum(), x)
        cases.append({"kind": kind, "logprob": _lists(logprob), "ref_logprob": _lists(ref), "kl": _lists(kl),
                      "grad": _lists(grad)})
    return cases


def main():
    ref = {"verl_version": verl.__version__, "torch_version": torch.__version__, "token_sum": token_sum_cases(),
           "policy_loss": policy_loss_cases(), "covariance_losses": covariance_loss_cases(),
           "estimators": estimator_cases(),
           "straight_through_kl": straight_through_kl_cases()}
    write_reference(OUT, ref)


if __name__ == "__main__":
    main()
