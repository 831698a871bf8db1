"""Rollout correction against verl 0.9.1's own outputs (tests/verl_reference/rollout_correction_verl_0_9_1.json,
written by tests/verl_reference/make_rollout_correction.py with verl installed, `make verl-reference`): the IS
weights, the rejected mask and every `rollout_corr/` metric of `compute_rollout_correction_and_rejection_mask`
for every rollout_is / rollout_rs mode and preset on random and hard inputs, verl's `training/rollout_probs_*`
debug metrics, and the policy losses with the weights (vanilla, GSPO, bypass ppo_clip / reinforce) and
their gradients; all within 1e-6."""
import json
import math
import os

import pytest
import torch

from hybridrl import algos

REF_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_reference",
                        "rollout_correction_verl_0_9_1.json")
with open(REF_PATH) as _f:
    REF = json.load(_f)

f32 = lambda x: torch.tensor(x, dtype=torch.float32)
TOL = 1e-6


def _inputs(name):
    x = REF["inputs"][name]
    return f32(x["old_log_prob"]), f32(x["rollout_log_prob"]), f32(x["response_mask"])


def _close(got: float, expect: float) -> bool:
    if math.isnan(expect) or math.isinf(expect):
        return math.isnan(got) if math.isnan(expect) else got == expect
    return math.isclose(got, expect, rel_tol=TOL, abs_tol=TOL)


def test_reference_is_verl_0_9_1_and_covers_every_mode():
    assert REF["verl_version"] == "0.9.1"
    kwargs = [c["kwargs"] for c in REF["cases"]]
    rs = {o.strip() for k in kwargs if k.get("rollout_rs") for o in k["rollout_rs"].split(",")}
    assert rs == set(algos.rollout_correction.RS_OPTIONS)
    assert {k.get("rollout_is") for k in kwargs} == {None, "token", "sequence"}
    assert {str(k.get("rollout_is_threshold")) for k in kwargs if k.get("rollout_is")} >= {"2.0", "0.5_5.0"}
    assert {k.get("rollout_is_batch_normalize") for k in kwargs} >= {True, False}
    assert {c["preset"] for c in REF["cases"]} - {None} == set(REF["presets"])
    assert set(REF["inputs"]) >= {"extreme_ratios", "one_token_rows", "single_token", "random_wide"}


def _case_id(case):
    return case["preset"] or ",".join(f"{k}={v}" for k, v in case["kwargs"].items()) or "metrics_only"


@pytest.mark.parametrize("case", REF["cases"], ids=_case_id)
def test_correction_weights_mask_and_metrics_match_verl(case):
    for name, expect in case["by_input"].items():
        old, rollout, mask = _inputs(name)
        weights, new_mask, metrics = algos.compute_rollout_correction_and_rejection_mask(old, rollout, mask,
                                                                                         **case["kwargs"])
        assert sorted(metrics) == case["metric_names"], name
        bad = {k: (metrics[k], v) for k, v in zip(case["metric_names"], expect["metrics"]) if not _close(metrics[k], v)}
        assert not bad, (name, bad)
        torch.testing.assert_close(new_mask, mask if expect["response_mask"] is None else f32(expect["response_mask"]),
                                   atol=0, rtol=0)
        if expect["weights"] is None:
            assert weights is None
        else:
            torch.testing.assert_close(weights, f32(expect["weights"]), atol=TOL, rtol=TOL)
            assert not weights.requires_grad


@pytest.mark.parametrize("case", REF["debug_metrics"], ids=lambda c: c["input"])
def test_rollout_probs_diff_metrics_match_verl(case):
    got = algos.rollout_probs_diff_metrics(*_inputs(case["input"]))
    assert set(got) == set(case["metrics"])
    bad = {k: (got[k], v) for k, v in case["metrics"].items() if not _close(got[k], v)}
    assert not bad, bad


def _loss_id(case):
    c = case["correction"]
    return f"{case['loss_mode']}-{c.get('loss_type', '')}-{c.get('rollout_is')}-{c.get('rollout_rs')}-{case['agg_mode']}"


@pytest.mark.parametrize("case", REF["losses"], ids=_loss_id)
def test_policy_losses_with_correction_match_verl(case):
    """Decoupled: the weights and mask of the correction (trainer vs engine) go into vanilla / GSPO. Bypass:
    old = the engine's, the correction of the current policy is made inside the loss (ppo_clip: PPO against
    the engine, weights only measured; reinforce: -A log pi times the weights)."""
    mask, agg, c = f32(case["mask"]), case["agg_mode"], case["correction"]
    rollout, old = f32(case["rollout_log_prob"]), f32(case["old_log_prob"])
    log_prob, adv = f32(case["log_prob"]).requires_grad_(True), f32(case["advantages"])
    correction = {k: v for k, v in c.items() if k not in ("bypass_mode", "loss_type")}
    metrics = {}
    if case["loss_mode"] == "bypass_mode":
        loss, stats, metrics, _ = algos.bypass_mode_policy_loss(
            rollout, log_prob, adv, mask, c["loss_type"], correction,
            surrogate=lambda *a, **kw: algos.policy_loss(*a, clip_low=0.2, clip_high=0.28, clip_c=3.0, **kw),
            agg_mode=agg)
    else:
        weights, loss_mask, _ = algos.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **correction)
        if case["loss_mode"] == "gspo":
            loss, stats = algos.gspo_policy_loss(old, log_prob, adv, loss_mask, 3e-4, 4e-4, agg_mode=agg,
                                                 rollout_is_weights=weights)
        else:
            loss, stats = algos.policy_loss(old, log_prob, adv, loss_mask, 0.2, 0.28, 3.0, agg_mode=agg,
                                            rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert _close(loss.item(), case["loss"]), (loss.item(), case["loss"])
    torch.testing.assert_close(grad, f32(case["grad"]), atol=TOL, rtol=1e-5)
    got = {**{f"actor/{k}": float(v) for k, v in stats.items()}, **metrics}
    assert set(got) == set(case["metrics"])
    bad = {k: (got[k], v) for k, v in case["metrics"].items() if not _close(got[k], v)}
    assert not bad, bad


HOLES = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0, 1, 0, 1, 0],
                      [0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize("kwargs", [dict(rollout_is="token", rollout_is_batch_normalize=True),
                                    dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0"),
                                    dict(rollout_rs=",".join(algos.rollout_correction.RS_OPTIONS),
                                         rollout_rs_threshold="0.5_2.0,0.3,0.3,0.2_5.0,1.0,1.0,0.5_2.0,0.1,0.1,0.3,0.3")])
def test_tool_tokens_never_count(kwargs):
    """Multi-turn: tool output sits in holes of the response mask; whatever log-probs it carries, weights,
    rejections and metrics are those of the model's tokens alone."""
    g = torch.Generator().manual_seed(7)
    old = -2.0 + torch.randn(HOLES.shape, generator=g)
    rollout = old + 0.4 * torch.randn(HOLES.shape, generator=g)
    noise = (1 - HOLES) * 30.0 * torch.randn(HOLES.shape, generator=g)
    clean = algos.compute_rollout_correction_and_rejection_mask(old, rollout, HOLES, **kwargs)
    noisy = algos.compute_rollout_correction_and_rejection_mask(old + noise, rollout - noise, HOLES, **kwargs)
    if clean[0] is not None:
        torch.testing.assert_close(noisy[0], clean[0], atol=0, rtol=0)
        assert (clean[0] * (1 - HOLES) == 0).all()
    torch.testing.assert_close(noisy[1], clean[1], atol=0, rtol=0)
    assert noisy[2] == clean[2]
    assert algos.rollout_probs_diff_metrics(old + noise, rollout - noise, HOLES) == \
        algos.rollout_probs_diff_metrics(old, rollout, HOLES)
