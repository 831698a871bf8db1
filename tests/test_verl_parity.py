"""hybridrl against verl 0.9.1's own outputs (tests/verl_reference/verl_0_9_1.json, written by
tests/verl_reference/make_reference.py in a side venv with verl installed, `make verl-reference`): loss
aggregation, the vanilla and GSPO policy losses and their gradients, GRPO / Dr. GRPO, RLOO, REINFORCE++
(over multi-turn masks with holes), REINFORCE++-baseline and ReMax advantages, the KL penalties past their
clamps, the clipped value loss, the adaptive KL controller and the KL-in-reward step, GSM8k scoring, DAPO's
overlong penalty and the validation metrics (mean@N, best@N, worst@N, maj@N); DAPO's math scorer (what verl routes
data_source "math" and aime* to) from tests/verl_reference/math_dapo_verl_0_9_1.json."""
import json
import math
import os

import pytest
import torch

from hybridrl import algos
from hybridrl.rewards import gsm8k
from hybridrl.rewards.overlong import overlong_penalty
from hybridrl.trainer.validation import process_validation_metrics

REF_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_reference", "verl_0_9_1.json")
with open(REF_PATH) as _f:
    REF = json.load(_f)

f32 = lambda x: torch.tensor(x, dtype=torch.float32)


def test_reference_is_verl_0_9_1():
    assert REF["verl_version"] == "0.9.1"


@pytest.mark.parametrize("case", REF["agg_loss"], ids=lambda c: f"{c['mode']}-{c['loss_scale_factor']}")
def test_agg_loss_matches_verl(case):
    out = algos.agg_loss(f32(case["loss_mat"]), f32(case["mask"]), case["mode"], case["loss_scale_factor"])
    assert math.isclose(out.item(), case["expect"], rel_tol=1e-6, abs_tol=1e-6), (out.item(), case["expect"])


@pytest.mark.parametrize("case", REF["policy_loss"], ids=lambda c: f"{c['loss_mode']}-{c['clip_low']}-{c['agg_mode']}")
def test_policy_losses_and_gradients_match_verl(case):
    fn = algos.gspo_policy_loss if case["loss_mode"] == "gspo" else algos.policy_loss
    log_prob = f32(case["log_prob"]).requires_grad_(True)
    args = (f32(case["old_log_prob"]), log_prob, f32(case["advantages"]), f32(case["mask"]),
            case["clip_low"], case["clip_high"])
    if case["loss_mode"] == "vanilla":
        args += (3.0,)
    loss, stats = fn(*args, agg_mode=case["agg_mode"])
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert math.isclose(loss.item(), case["loss"], rel_tol=1e-5, abs_tol=1e-6), (loss.item(), case["loss"])
    torch.testing.assert_close(grad, f32(case["grad"]), atol=1e-6, rtol=1e-5)
    for key, value in case["metrics"].items():
        assert math.isclose(float(stats[key.split("/")[1]]), value, abs_tol=1e-6), key


@pytest.mark.parametrize("case", REF["grpo"], ids=lambda c: f"norm_by_std={c['norm_by_std']}")
def test_grpo_and_dr_grpo_advantages_match_verl(case):
    adv, _ = algos.compute_grpo_advantages(f32(case["scores"]), f32(case["mask"]), case["index"],
                                           norm_by_std=case["norm_by_std"])
    torch.testing.assert_close(adv, f32(case["advantages"]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", REF["outcome_advantages"], ids=lambda c: c["estimator"])
def test_rloo_and_reinforce_pp_baseline_advantages_match_verl(case):
    adv, _ = algos.compute_advantages(case["estimator"], token_rewards=f32(case["token_level_rewards"]),
                                      response_mask=f32(case["mask"]), group_index=case["index"])
    torch.testing.assert_close(adv, f32(case["advantages"]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", REF["reinforce_plus_plus"], ids=lambda c: f"gamma{c['gamma']}")
def test_reinforce_pp_over_masks_with_holes_matches_verl(case):
    """verl 0.9.1 carries the running return through masked tokens (tool output) and stores 0 there."""
    mask = f32(case["mask"])
    adv, returns = algos.compute_advantages("reinforce_plus_plus", token_rewards=f32(case["token_level_rewards"]),
                                            response_mask=mask, gamma=case["gamma"])
    torch.testing.assert_close(adv, f32(case["advantages"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, f32(case["returns"]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", REF["remax"], ids=lambda c: f"b{len(c['mask'])}")
def test_remax_advantages_match_verl(case):
    adv, returns = algos.compute_advantages("remax", token_rewards=f32(case["token_level_rewards"]),
                                            response_mask=f32(case["mask"]),
                                            baseline_scores=f32(case["reward_baselines"]))
    torch.testing.assert_close(adv, f32(case["advantages"]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(returns, f32(case["returns"]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", REF["kl_penalty"], ids=lambda c: c["kind"])
def test_kl_penalty_and_its_clamps_match_verl(case):
    kl = algos.kl_penalty(f32(case["logprob"]), f32(case["ref_logprob"]), case["kind"])
    torch.testing.assert_close(kl, f32(case["kl"]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", REF["value_loss"], ids=lambda c: f"{c['agg_mode']}-{c['cliprange_value']}")
def test_value_loss_clipfrac_and_gradient_match_verl(case):
    vpreds = f32(case["vpreds"]).requires_grad_(True)
    loss, clipfrac = algos.value_loss(vpreds, f32(case["values"]), f32(case["returns"]), f32(case["mask"]),
                                      case["cliprange_value"], case["agg_mode"])
    (grad,) = torch.autograd.grad(loss, vpreds)
    assert math.isclose(loss.item(), case["loss"], rel_tol=1e-6, abs_tol=1e-6), (loss.item(), case["loss"])
    assert math.isclose(clipfrac.item(), case["clipfrac"], abs_tol=1e-7)
    assert 0 < case["clipfrac"] < 1
    torch.testing.assert_close(grad, f32(case["grad"]), atol=1e-6, rtol=1e-5)


def test_adaptive_kl_controller_matches_verl():
    ref = REF["kl_controller"]["adaptive"]
    ctrl = algos.make_kl_controller("adaptive", ref["init_kl_coef"], ref["target_kl"], ref["horizon"])
    for kl, n_steps, value in zip(ref["observed"], ref["n_steps"], ref["values"]):
        ctrl.update(kl, n_steps)
        assert math.isclose(ctrl.value, value, rel_tol=1e-12), (kl, n_steps, ctrl.value, value)


@pytest.mark.parametrize("case", REF["kl_controller"]["apply_kl_penalty"], ids=lambda c: c["kind"])
def test_kl_in_reward_step_matches_verl(case):
    """verl's ray_trainer.apply_kl_penalty: rewards with coef * KL, the batch-mean KL it reports, and the
    controller's update by n_steps = the batch's rows (what PPOTrainer passes; test_trainer checks that)."""
    mask = f32(case["mask"])
    ctrl = algos.make_kl_controller("adaptive", case["init_kl_coef"], case["target_kl"], case["horizon"])
    rewards, kl = algos.apply_kl_penalty(f32(case["token_level_scores"]), f32(case["old_log_probs"]),
                                         f32(case["ref_log_prob"]), mask, ctrl.value, case["kind"])
    torch.testing.assert_close(rewards, f32(case["token_level_rewards"]), atol=1e-6, rtol=1e-6)
    assert math.isclose(float(kl), case["metrics"]["actor/reward_kl_penalty"], rel_tol=1e-6)
    assert ctrl.value == case["metrics"]["actor/reward_kl_penalty_coeff"]
    ctrl.update(float(kl), n_steps=mask.shape[0])
    assert math.isclose(ctrl.value, case["coef_after"], rel_tol=1e-6)


def test_gsm8k_strict_and_flexible_match_verl():
    mismatches = []
    for case in REF["gsm8k"]:
        answer = gsm8k.extract_solution(case["text"], case["method"])
        score = gsm8k.compute_score(case["text"], case["ground_truth"], method=case["method"])
        if answer != case["answer"] or score != case["score"]:
            mismatches.append((case, answer, score))
    assert not mismatches, mismatches[:3]
    assert len({c["score"] for c in REF["gsm8k"]}) == 2, "the reference holds both right and wrong answers"


@pytest.mark.parametrize("case", REF["overlong"], ids=lambda c: f"len{c['len']}")
def test_overlong_penalty_matches_verl_dapo_reward_manager(case):
    shaped = f32(case["scores"]) + overlong_penalty(torch.tensor(case["lengths"]), case["max_response_length"],
                                                    case["len"], case["penalty_factor"])
    assert shaped.tolist() == f32(case["rewards"]).tolist()


@pytest.mark.parametrize("case", REF["validation"], ids=lambda c: f"n{len(c['uids']) // 7}")
def test_validation_metrics_match_verl_bootstrap(case):
    got = process_validation_metrics(case["data_sources"], case["uids"], case["infos"])
    expect = case["expect"]
    assert set(got) == set(expect)
    for source, per_var in expect.items():
        assert set(got[source]) == set(per_var), source  # "pred" is a string: votes, not a metric
        for var, metrics in per_var.items():
            assert set(got[source][var]) == set(metrics), (source, var)
            for name, value in metrics.items():
                assert math.isclose(got[source][var][name], value, rel_tol=1e-12, abs_tol=1e-12), (source, var, name)


with open(os.path.join(os.path.dirname(REF_PATH), "math_dapo_verl_0_9_1.json")) as _f:
    MATH_DAPO = json.load(_f)


def test_dapo_math_scorer_matches_verl():
    from hybridrl.rewards import RewardManager
    from hybridrl.config import RewardConfig

    assert MATH_DAPO["verl_version"] == "0.9.1" and len(MATH_DAPO["cases"]) > 100
    cases = MATH_DAPO["cases"]
    assert 0 < sum(c["acc"] for c in cases) < len(cases)  # both verdicts, through both the Answer: and the box paths
    scores, extra = RewardManager(RewardConfig()).score_batch([c["solution"] for c in cases], ["math"] * len(cases),
                                                              [c["ground_truth"] for c in cases])
    for i, c in enumerate(cases):
        got = (scores[i].item(), extra["acc"][i], extra["pred"][i])
        assert got == (c["score"], float(c["acc"]), c["pred"]), (c["solution"][-80:], c["ground_truth"], got)


# ---- the algorithms added later: tests/verl_reference/more_algos_verl_0_9_1.json (make_more_algos.py) -------

with open(os.path.join(os.path.dirname(REF_PATH), "more_algos_verl_0_9_1.json")) as _f:
    MORE = json.load(_f)


def test_more_reference_is_verl_0_9_1():
    assert MORE["verl_version"] == "0.9.1"


def _same_loss_as_verl(loss, log_prob, stats, case):
    """The loss, its gradient with respect to log_prob and every metric verl reported (and no other)."""
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert math.isclose(loss.item(), case["loss"], rel_tol=1e-5, abs_tol=1e-6), (loss.item(), case["loss"])
    torch.testing.assert_close(grad, f32(case["grad"]), atol=1e-6, rtol=1e-5)
    assert {k.split("/")[1] for k in case["metrics"]} == set(stats)
    for key, value in case["metrics"].items():
        assert math.isclose(float(stats[key.split("/")[1]]), value, abs_tol=1e-6), key


@pytest.mark.parametrize("case", MORE["token_sum"], ids=lambda c: f"b{len(c['mask'])}")
def test_token_sum_matches_verl(case):
    out = algos.agg_loss(f32(case["loss_mat"]), f32(case["mask"]), "token-sum")
    assert math.isclose(out.item(), case["expect"], rel_tol=1e-6, abs_tol=1e-6)


@pytest.mark.parametrize("case", MORE["policy_loss"], ids=lambda c: f"{c['loss_mode']}-{c['agg_mode']}")
def test_cispo_gpg_dro_losses_and_gradients_match_verl(case):
    import functools

    from hybridrl.algos import token_losses

    fn = {"cispo": functools.partial(token_losses.cispo_policy_loss, clip_low=case["clip_low"],
                                     clip_high=case["clip_high"]),
          "gpg": token_losses.gpg_policy_loss,
          "dro": functools.partial(token_losses.dro_policy_loss, beta=case["dro_beta"])}[case["loss_mode"]]
    log_prob = f32(case["log_prob"]).requires_grad_(True)
    loss, stats = fn(f32(case["old_log_prob"]), log_prob, f32(case["advantages"]), f32(case["mask"]),
                     agg_mode=case["agg_mode"])
    _same_loss_as_verl(loss, log_prob, stats, case)


@pytest.mark.parametrize("case", MORE["estimators"], ids=lambda c: f"{c['estimator']}-{c['norm_by_std']}")
def test_passk_opo_gpg_advantages_match_verl(case):
    adv, ret = algos.compute_advantages(case["estimator"], token_rewards=f32(case["token_level_rewards"]),
                                        response_mask=f32(case["mask"]), group_index=case["index"],
                                        norm_by_std=case["norm_by_std"])
    torch.testing.assert_close(adv, f32(case["advantages"]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret, f32(case["returns"]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", MORE["straight_through_kl"], ids=lambda c: c["kind"])
def test_straight_through_kl_matches_verl(case):
    x = f32(case["logprob"]).requires_grad_(True)
    kl = algos.kl_penalty(x, f32(case["ref_logprob"]), case["kind"])
    (grad,) = torch.autograd.grad(kl.sum(), x)
    torch.testing.assert_close(kl.detach(), f32(case["kl"]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, f32(case["grad"]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", MORE["covariance_losses"], ids=lambda c: f"{c['loss_mode']}-{c['agg_mode']}")
def test_geo_mean_clip_cov_kl_cov_match_verl(case):
    """GMPO divides by every response (verl's torch.mean), hybridrl's function by those with a loss token (the
    trainer's share then divides by every row); Clip-Cov draws the same tokens from the same torch seed."""
    import functools

    from hybridrl.algos import covariance_losses, token_losses

    fn = {"geo_mean": functools.partial(token_losses.geo_mean_policy_loss, clip_low=case["clip_low"],
                                        clip_high=case["clip_high"]),
          "clip_cov": functools.partial(covariance_losses.clip_cov_policy_loss, clip_low=case["clip_low"],
                                        clip_high=case["clip_high"], cov_ratio=case["cov_ratio"], cov_lb=case["cov_lb"],
                                        cov_ub=case["cov_ub"], agg_mode=case["agg_mode"]),
          "kl_cov": functools.partial(covariance_losses.kl_cov_policy_loss, cov_ratio=case["cov_ratio"],
                                      kl_coef=case["kl_coef"], agg_mode=case["agg_mode"])}[case["loss_mode"]]
    mask = f32(case["mask"])
    log_prob = f32(case["log_prob"]).requires_grad_(True)
    torch.manual_seed(case["seed"])
    loss, stats = fn(f32(case["old_log_prob"]), log_prob, f32(case["advantages"]), mask)
    if case["loss_mode"] == "geo_mean":
        loss = loss * (mask.sum(-1) > 0).sum() / mask.shape[0]
    _same_loss_as_verl(loss, log_prob, stats, case)


@pytest.mark.parametrize("case", MORE["trust_region_losses"], ids=lambda c: f"{c['loss_mode']}-{c['agg_mode']}")
def test_sapo_and_dppo_losses_and_gradients_match_verl(case):
    """SAPO's soft gate (its own seq-mean-token-mean whatever the aggregation) and DPPO's probability-space trust
    region (tokens dropped both ways, importance weights truncated at clip_c) against verl 0.9.1's outputs, through
    the actor's config as verl's is set (clip_ratio_low/high, clip_ratio_c, tau_pos/tau_neg off their defaults)."""
    from hybridrl.config import ActorConfig, PolicyLossConfig
    from hybridrl.workers.actor import _surrogate

    cfg = ActorConfig(clip_ratio_low=case["clip_low"], clip_ratio_high=case["clip_high"], clip_ratio_c=case["clip_c"],
                      tau_pos=case["tau_pos"], tau_neg=case["tau_neg"], loss_agg_mode=case["agg_mode"],
                      policy_loss=PolicyLossConfig(loss_mode=case["loss_mode"]))
    fn = _surrogate(cfg)
    log_prob = f32(case["log_prob"]).requires_grad_(True)
    loss, stats = fn(f32(case["old_log_prob"]), log_prob, f32(case["advantages"]), f32(case["mask"]),
                     agg_mode=case["agg_mode"])
    _same_loss_as_verl(loss, log_prob, stats, case)
    if case["loss_mode"] != "sapo":  # each case drops some tokens and keeps others
        assert 0 < case["metrics"]["actor/pg_clipfrac"] < 1


def test_the_dppo_references_truncate_importance_weights():
    """Both DPPO losses' reference cases include kept tokens whose importance weight passed clip_c."""
    for mode in ("dppo_tv", "dppo_kl"):
        assert any(c["metrics"]["actor/pg_clipfrac_lower"] > 0 for c in MORE["trust_region_losses"]
                   if c["loss_mode"] == mode), mode


@pytest.mark.parametrize("case", MORE["optimal_token_baseline"],
                         ids=lambda c: f"{c['estimator']}-{'is-weights' if c['rollout_is_weights'] else 'no-weights'}")
def test_optimal_token_baselines_match_verl(case):
    """Per-step baselines weighted by the cumulative path variance, per group; the zero tail of a group's one longest
    response (not of a tie), no baseline for a singleton; W scaled by the squared IS weights where given. The
    multi-turn form counts steps in each response's own tokens (holes skipped) and drops empty responses."""
    weights = case["rollout_is_weights"]
    adv, ret = algos.compute_advantages(
        case["estimator"], token_rewards=f32(case["token_level_rewards"]), response_mask=f32(case["mask"]),
        group_index=case["index"], old_log_probs=f32(case["old_log_probs"]), sum_pi_squared=f32(case["sum_pi_squared"]),
        rollout_is_weights=None if weights is None else f32(weights))
    torch.testing.assert_close(adv, f32(case["advantages"]), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ret, f32(case["returns"]), atol=1e-6, rtol=1e-6)
    assert not torch.equal(adv, ret * f32(case["mask"]))  # a baseline was subtracted


@pytest.mark.parametrize("case", MORE["gdpo"], ids=lambda c: "-".join(c["keys"]))
def test_gdpo_matches_verl(case):
    """Each reward component normalised within its group apart (a group whose component is all equal gives 0 there),
    the weighted sum whitened over the loss tokens: verl's values from its trainer's inputs."""
    mask = f32(case["mask"])
    adv, ret = algos.compute_advantages("gdpo", response_mask=mask, group_index=case["index"],
                                        components=[f32(c) for c in case["components"]],
                                        component_weights=case["weights"], norm_by_std=False)  # not read by GDPO
    torch.testing.assert_close(adv, f32(case["advantages"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, f32(case["returns"]), atol=1e-5, rtol=1e-5)
