"""Write more_algos_verl_0_9_1.json: verl 0.9.1's own outputs for the algorithms added after verl_0_9_1.json was
written, the reference of the tests at the end of tests/test_verl_parity.py.

Run in the side venv that has verl (`make verl-reference`). Inputs are drawn here with fixed seeds and stored
beside verl's outputs. Covered: core_algos.agg_loss "token-sum"; the cispo, gpg and dro policy losses (loss,
metrics and the gradient with respect to log_prob, every aggregation); the grpo_passk (with and without std
normalisation, tied best scores included), opo and gpg advantage estimators; kl_penalty's straight-through
"+" kinds (value and gradient); the geo_mean, clip_cov and kl_cov policy losses; the sapo, dppo_tv and dppo_kl
policy losses (every aggregation; tau_pos / tau_neg and the DPPO bounds away from verl's defaults); the
gdpo estimator (two and three reward components, with and without weights); the optimal_token_baseline estimator
and its multi-turn form tir_optimal_token_baseline (with and without rollout IS
weights, a group whose one longest response has a zero tail, a tie for the longest, a singleton; for the multi-turn
form, masks with holes and a response without a loss token inside a group).
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

from make_reference import HOLE_MASKS, _lists, _masks, _outcome_rewards, write_reference

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


def _loss_inputs(g, old_mean: float, move: float, adv_scale: float = 1.0, top: float | None = None) -> tuple:
    """(mask, old log-probs, new log-probs with a gradient, advantages) of a 6 x 10 case: old ~ N(old_mean, 0.5),
    new = old + N(0, move), one advantage per row; `top` caps both log-probs (probabilities below 1)."""
    b, t = 6, 10
    mask = _masks(g, b, t)
    old = old_mean + 0.5 * torch.randn(b, t, generator=g)
    old = old if top is None else old.clamp(max=top)
    new = old + move * torch.randn(b, t, generator=g)
    new = (new if top is None else new.clamp(max=top)).requires_grad_(True)
    adv = (adv_scale * torch.randn(b, 1, generator=g) * torch.ones(1, t)) * mask
    return mask, old, new, adv


def _loss_case(loss_mode: str, mode: str, cfg, old, new, adv, mask, **params) -> dict:
    """verl's loss of one case, its gradient with respect to `new` and its metrics, beside the inputs."""
    loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(old, new, adv, mask, loss_agg_mode=mode, config=cfg)
    (grad,) = torch.autograd.grad(loss, new)
    return {"loss_mode": loss_mode, "agg_mode": mode, **params,
            "old_log_prob": _lists(old), "log_prob": _lists(new.detach()), "advantages": _lists(adv),
            "mask": _lists(mask), "loss": float(loss.detach()), "grad": _lists(grad),
            "metrics": {k: float(v) for k, v in metrics.items()}}


def policy_loss_cases():
    g = torch.Generator().manual_seed(32)
    cases = []
    for loss_mode in ("cispo", "gpg", "dro"):
        for mode in MODES:
            mask, old, new, adv = _loss_inputs(g, -2.0, 0.3)  # ratios past both clip edges
            cfg = ActorConfig(strategy="megatron", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                              loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1,
                              policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.5))
            cases.append(_loss_case(loss_mode, mode, cfg, old, new, adv, mask, clip_low=0.2, clip_high=0.28,
                                    dro_beta=0.5))
    return cases


def covariance_loss_cases():
    """geo_mean (GMPO), clip_cov (torch.manual_seed(seed) right before each call: it draws with torch.randperm)
    and kl_cov, with shares and bounds large enough that several tokens are picked."""
    g = torch.Generator().manual_seed(35)
    cases = []
    for loss_mode in ("geo_mean", "clip_cov", "kl_cov"):
        for mode in ("token-mean", "seq-mean-token-sum"):
            mask, old, new, adv = _loss_inputs(g, -2.0, 0.3, adv_scale=3.0)
            cfg = ActorConfig(strategy="megatron", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                              loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1,
                              policy_loss=PolicyLossConfig(loss_mode=loss_mode, clip_cov_ratio=0.2, clip_cov_lb=0.5,
                                                           clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.3))
            seed = len(cases)
            torch.manual_seed(seed)
            cases.append(_loss_case(loss_mode, mode, cfg, old, new, adv, mask, seed=seed, clip_low=0.2, clip_high=0.28,
                                    cov_ratio=0.2, cov_lb=0.5, cov_ub=5.0, kl_coef=0.3))
    return cases


def trust_region_loss_cases():
    """sapo, dppo_tv and dppo_kl: probabilities near 0.5 and moves of either sign large enough that the DPPO bounds
    drop tokens in both directions and some importance weights pass clip_ratio_c (2.0 here)."""
    g = torch.Generator().manual_seed(36)
    cases = []
    for loss_mode in ("sapo", "dppo_tv", "dppo_kl"):
        for mode in MODES:
            mask, old, new, adv = _loss_inputs(g, -0.7, 0.8, top=-0.01)
            low, high = (0.05, 0.08) if loss_mode == "dppo_kl" else (0.1, 0.15)
            cfg = ActorConfig(strategy="megatron", clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high,
                              clip_ratio_c=2.0, tau_pos=1.5, tau_neg=3.0, loss_agg_mode=mode,
                              ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1,
                              policy_loss=PolicyLossConfig(loss_mode=loss_mode))
            cases.append(_loss_case(loss_mode, mode, cfg, old, new, adv, mask, clip_low=low, clip_high=high, clip_c=2.0,
                                    tau_pos=1.5, tau_neg=3.0))
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


def token_baseline_cases():
    g = torch.Generator().manual_seed(37)
    b, t = 14, 8
    lengths = torch.tensor([8, 5, 3, 6, 4, 4, 2, 4, 7, 7, 1, 3, 0, 5])  # groups [0:4] (8 longest alone), [4:8],
    mask = (torch.arange(t)[None] < lengths[:, None]).float()                # [8:12] (7 tied), [12:13], [13:14]
    index = np.array([0] * 4 + [1] * 4 + [2] * 4 + [3, 4])
    rewards = torch.randn(b, t, generator=g) * mask * (torch.rand(b, t, generator=g) < 0.4)  # sparse dense rewards
    old = (-1.5 + 0.7 * torch.randn(b, t, generator=g)).clamp(max=-0.01)
    sum_pi_squared = torch.rand(b, t, generator=g) * 0.6 + 0.05
    is_weights = torch.exp(0.3 * torch.randn(b, t, generator=g))
    cases = []
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        if name.startswith("tir"):  # holes inside trajectories, and an empty response in the second group
            t = 10
            mask = torch.tensor([HOLE_MASKS[i % len(HOLE_MASKS)] for i in range(b)], dtype=torch.float32)
            mask[5] = 0.0
            rewards = torch.randn(b, t, generator=g) * mask * (torch.rand(b, t, generator=g) < 0.4)
            old = (-1.5 + 0.7 * torch.randn(b, t, generator=g)).clamp(max=-0.01)
            sum_pi_squared = torch.rand(b, t, generator=g) * 0.6 + 0.05
            is_weights = torch.exp(0.3 * torch.randn(b, t, generator=g))
        cases += _token_baseline_runs(name, rewards, mask, index, old, sum_pi_squared, is_weights)
    return cases


def _token_baseline_runs(name, rewards, mask, index, old, sum_pi_squared, is_weights) -> list:
    cases = []
    for weights in (None, is_weights):
        adv, ret = core_algos.get_adv_estimator_fn(name)(
            token_level_rewards=rewards.clone(), response_mask=mask, index=index, old_log_probs=old,
            sum_pi_squared=sum_pi_squared, rollout_is_weights=weights)
        cases.append({"estimator": name, "token_level_rewards": _lists(rewards), "mask": _lists(mask),
                      "index": index.tolist(),
                      "old_log_probs": _lists(old), "sum_pi_squared": _lists(sum_pi_squared),
                      "rollout_is_weights": None if weights is None else _lists(weights),
                      "advantages": _lists(adv), "returns": _lists(ret)})
    return cases


def gdpo_cases():
    """verl's trainer hands GDPO the config, the per-response reward components (non_tensor_batch) and the batch (its
    prompt width and attention mask place each value on the response's last token)."""
    g = torch.Generator().manual_seed(38)
    cases = []
    for keys, weights in ((["format_reward", "accuracy_reward"], None), (["a", "b", "c"], [1.0, 0.5, 2.0])):
        b, p, t = 12, 3, 7
        mask = _masks(g, b, t)
        mask[1, 0] = 1.0  # every response has a token
        values = {k: np.round(np.asarray(torch.rand(b, generator=g) * (1 + 4 * i)), 1).astype(np.float32)
                  for i, k in enumerate(keys)}
        values[keys[0]][:4] = 1.0  # a group whose first component is all equal (std 0)
        index = np.array([i // 4 for i in range(b)])
        cfg = AlgoConfig(gdpo_reward_keys=keys, gdpo_reward_weights=weights)
        batch = {"prompts": torch.ones(b, p, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(b, p), mask], 1).long()}
        adv, ret = core_algos.get_adv_estimator_fn("gdpo")(
            token_level_rewards=torch.zeros(b, t), response_mask=mask, index=index, config=cfg,
            non_tensor_batch=values, batch=batch)
        cases.append({"keys": keys, "weights": weights, "components": [values[k].tolist() for k in keys],
                      "mask": _lists(mask), "index": index.tolist(), "advantages": _lists(adv), "returns": _lists(ret)})
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
           "trust_region_losses": trust_region_loss_cases(),
           "estimators": estimator_cases(), "optimal_token_baseline": token_baseline_cases(), "gdpo": gdpo_cases(),
           "straight_through_kl": straight_through_kl_cases()}
    write_reference(OUT, ref)


if __name__ == "__main__":
    main()
