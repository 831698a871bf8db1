"""Hand-computed checks of hybridrl.algos (CPU, fast)."""

import ast
import inspect
import math
import random

import pytest
import torch

from hybridrl import algos
from hybridrl.algos import (
    ADV_ESTIMATORS, AdaptiveKLController, FixedKLController, agg_loss, apply_kl_penalty,
    compute_advantages, compute_gae_advantages, compute_grpo_advantages,
    compute_reinforce_pp_advantages, compute_reinforce_pp_baseline_advantages,
    compute_remax_advantages, compute_rloo_advantages, entropy_from_logits, entropy_loss,
    get_adv_estimator, kl_penalty, make_kl_controller, masked_mean, masked_var, masked_whiten,
    policy_loss, token_rewards_from_scores, value_loss,
)

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


def whiten_ref(vals):
    """Whiten a python list: unbiased variance, eps 1e-8."""
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in vals]


# ----------------------------------------------------------------------------- masked stats


def test_masked_mean_all_and_dim():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    close(masked_mean(x, m), 7.0 / 3)
    close(masked_mean(x, m, dim=-1), [1.5, 4.0, 0.0])  # fully masked row -> 0
    close(masked_mean(x, m.bool()), 7.0 / 3)
    close(masked_mean(x, torch.zeros_like(m)), 0.0)


def test_masked_mean_ignores_nan_under_mask():
    x = t([[1.0, float("nan")], [3.0, float("inf")]])
    m = t([[1, 0], [1, 0]])
    close(masked_mean(x, m), 2.0)


def test_masked_var_unbiased_and_biased():
    x = t([[1.0, 2.0, 99.0], [4.0, -5.0, 0.0]])
    m = t([[1, 1, 0], [1, 0, 0]])
    # values 1, 2, 4: mean 7/3, sum of squares of deviations 42/9
    close(masked_var(x, m), 42.0 / 9 / 2)
    close(masked_var(x, m, unbiased=False), 42.0 / 9 / 3)
    close(masked_var(x, m), torch.var(t([1.0, 2.0, 4.0])))


def test_masked_var_edge_cases():
    x = t([[1.0, 2.0]])
    with pytest.raises(ValueError, match="no element"):
        masked_var(x, t([[0, 0]]))
    close(masked_var(x, t([[0, 1]])), 0.0)  # single element: 0, not NaN


def test_masked_whiten():
    x = t([[1.0, 2.0, 99.0], [4.0, -5.0, 0.0]])
    m = t([[1, 1, 0], [1, 0, 0]])
    w = masked_whiten(x, m)
    mean, var = 7.0 / 3, 42.0 / 9 / 2
    close(w, (x - mean) / math.sqrt(var + 1e-8))
    close(masked_mean(w, m), 0.0)
    close(masked_whiten(x, m, shift_mean=False), (x - mean) / math.sqrt(var + 1e-8) + mean)


# ----------------------------------------------------------------------------- GAE


def test_gae_by_hand():
    r = t([[0.0, 1.0, 0.0]])
    v = t([[0.5, 0.2, 9.0]])
    m = t([[1, 1, 0]])
    adv, ret = compute_gae_advantages(r, v, m, gamma=0.9, lam=0.8)
    # t=2 masked: skipped.  t=1: delta = 1 - 0.2 = 0.8.
    # t=0: delta = 0.9*0.2 - 0.5 = -0.32; A0 = -0.32 + 0.72*0.8 = 0.256
    raw = [0.256, 0.8, 0.0]
    close(ret, [[0.256 + 0.5, 0.8 + 0.2, 0.0 + 9.0]])
    w = whiten_ref(raw[:2])
    close(adv, [[w[0], w[1], 0.0]])


def test_gae_skips_masked_hole():
    # Middle token is tool output: the recursion jumps over it.
    r = t([[0.0, 7.0, 1.0], [0.0, 0.0, 2.0]])
    v = t([[0.3, 5.0, 0.4], [0.1, 0.2, 0.3]])
    m = t([[1, 0, 1], [1, 1, 1]])
    adv, ret = compute_gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    a02 = 1.0 - 0.4
    a00 = (0.0 + 0.4 - 0.3) + a02
    a12 = 2.0 - 0.3
    a11 = 0.3 - 0.2 + a12
    a10 = 0.2 - 0.1 + a11
    close(ret, [[a00 + 0.3, a02 + 5.0, a02 + 0.4], [a10 + 0.1, a11 + 0.2, a12 + 0.3]])
    w = whiten_ref([a00, a02, a10, a11, a12])
    close(adv, [[w[0], 0.0, w[1]], [w[2], w[3], w[4]]])


def gae_reference(r, v, m, gamma, lam):
    """Scalar python GAE with masked positions skipped, then masked whitening."""
    B, T = len(r), len(r[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_v, last = 0.0, 0.0
        for i in reversed(range(T)):
            if m[b][i]:
                last = r[b][i] + gamma * next_v - v[b][i] + gamma * lam * last
                next_v = v[b][i]
            adv[b][i] = last
    ret = [[adv[b][i] + v[b][i] for i in range(T)] for b in range(B)]
    flat = [adv[b][i] for b in range(B) for i in range(T) if m[b][i]]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    white = [[(adv[b][i] - mean) / math.sqrt(var + 1e-8) * m[b][i] for i in range(T)] for b in range(B)]
    return white, ret


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_python_reference(seed, holes):
    rng = random.Random(seed)
    B, T = 5, 9
    gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.8, 1.0)
    lengths = [rng.randint(0, T) for _ in range(B)]
    lengths[0] = T  # at least one full row
    m = [[1 if i < n else 0 for i in range(T)] for n in lengths]
    if holes:  # multi-turn: some interior tokens masked
        m = [[x if rng.random() > 0.25 else 0 for x in row] for row in m]
        m[0][0] = m[0][1] = 1
    r = [[rng.gauss(0, 1) if m[b][i] else 0.0 for i in range(T)] for b in range(B)]
    v = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
    adv, ret = compute_gae_advantages(t(r), t(v), t(m), gamma, lam)
    ref_adv, ref_ret = gae_reference(r, v, m, gamma, lam)
    close(adv, ref_adv, tol=1e-10)
    close(ret, ref_ret, tol=1e-10)


# ----------------------------------------------------------------------------- group estimators


def test_grpo_by_hand():
    scores = t([1.0, 3.0, 2.0, 2.0, 2.0, 5.0])
    ids = ["a", "a", "b", "b", "b", "c"]
    m = t([[1, 1]] * 5 + [[1, 0]])
    adv, ret = compute_grpo_advantages(scores, m, ids)
    s2 = math.sqrt(2.0)  # std of {1, 3}
    expect = [-1 / (s2 + 1e-6), 1 / (s2 + 1e-6), 0.0, 0.0, 0.0, 5.0 / (1 + 1e-6)]
    close(adv, [[e, e] for e in expect[:5]] + [[expect[5], 0.0]])
    assert torch.equal(adv, ret)
    # identical scores: std 0 -> exactly 0, no NaN
    assert torch.all(adv[2:5] == 0)


def test_grpo_no_std_and_tensor_ids():
    scores = t([1.0, 3.0, 2.0, 2.0, 2.0, 5.0])
    m = torch.ones(6, 3, dtype=torch.bool)
    adv, _ = compute_grpo_advantages(scores, m, torch.tensor([7, 7, 3, 3, 3, 9]), norm_by_std=False)
    close(adv, t([-1.0, 1.0, 0.0, 0.0, 0.0, 5.0])[:, None].expand(6, 3))
    with pytest.raises(ValueError, match="group_index"):
        compute_grpo_advantages(scores, m, [0, 1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_matches_loop_with_torch_std(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(24, generator=g, dtype=D)
    ids = torch.randint(0, 7, (24,), generator=g).tolist()
    m = torch.ones(24, 2, dtype=D)
    adv, _ = compute_grpo_advantages(scores, m, ids)
    for i in range(24):
        grp = scores[[j for j in range(24) if ids[j] == ids[i]]]
        mean, std = (grp.mean(), grp.std()) if len(grp) > 1 else (0.0, 1.0)
        close(adv[i, 0], (scores[i] - mean) / (std + 1e-6), tol=1e-10)


def test_rloo_by_hand():
    scores = t([1.0, 3.0, 5.0, 2.0, 4.0, 4.0])
    ids = [0, 0, 0, 1, 2, 2]
    m = t([[1, 1, 0]] * 6)
    adv, ret = compute_rloo_advantages(scores, m, ids)
    # leave-one-out: 1 - (3+5)/2 = -3, 3 - 3 = 0, 5 - 2 = 3; singleton keeps its score
    expect = [-3.0, 0.0, 3.0, 2.0, 0.0, 0.0]
    close(adv, [[e, e, 0.0] for e in expect])
    assert torch.equal(adv, ret)


def test_reinforce_pp_by_hand():
    r = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_pp_advantages(r, m, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    w = whiten_ref([0.25, 0.5, 1.0, 1.0, 2.0])
    close(adv, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]])


def test_reinforce_pp_carries_the_return_through_a_masked_token():
    r = t([[1.0, 5.0, 4.0]])
    m = t([[1, 0, 1]])
    adv, ret = compute_reinforce_pp_advantages(r, m, gamma=0.5)
    # verl 0.9.1: a masked token (tool output) stores 0, ignores its reward and passes the running
    # return on as it is: 4, then 1 + 0.5 * 4 (the reward after the hole reaches the turn before it)
    close(ret, [[3.0, 0.0, 4.0]])
    w = whiten_ref([3.0, 4.0])
    close(adv, [[w[0], 0.0, w[1]]])


def test_reinforce_pp_baseline_by_hand():
    scores = t([1.0, 3.0, 10.0])
    m = t([[1, 1], [1, 0], [1, 1]])
    adv, ret = compute_reinforce_pp_baseline_advantages(scores, m, ["a", "a", "b"])
    # group a mean 2 -> -1, +1; singleton b: mean 0 -> 10
    w = whiten_ref([-1.0, -1.0, 1.0, 10.0, 10.0])
    close(adv, [[w[0], w[1]], [w[2], 0.0], [w[3], w[4]]])
    assert torch.equal(adv, ret)


def test_remax_by_hand():
    r = t([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0]])
    m = t([[1, 1, 0], [1, 1, 1]])
    adv, ret = compute_remax_advantages(r, t([0.5, 1.0]), m)
    close(ret, [[1.0, 1.0, 0.0], [4.0, 1.0, 1.0]])
    close(adv, [[0.5, 0.5, 0.0], [3.0, 0.0, 0.0]])


def test_token_rewards_from_scores():
    m = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = token_rewards_from_scores(t([1.0, 2.0, 3.0]), m.bool())
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- registry


def test_registry_names_match_config():
    from hybridrl.config import ADV_ESTIMATORS as CONFIG_NAMES
    assert set(ADV_ESTIMATORS) == set(CONFIG_NAMES)
    for name in CONFIG_NAMES:
        assert get_adv_estimator(name) is ADV_ESTIMATORS[name]


def test_unknown_estimator_message():
    with pytest.raises(ValueError) as e:
        get_adv_estimator("ppo2")
    msg = str(e.value)
    assert "ppo2" in msg and "grpo" in msg and "reinforce_plus_plus_baseline" in msg
    with pytest.raises(ValueError, match="ppo2"):
        compute_advantages("ppo2", response_mask=t([[1]]))


def test_compute_advantages_dispatch():
    m = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    r = token_rewards_from_scores(t([1.0, 0.0, 2.0, 5.0]), m)
    v = t([[0.1, 0.2, 0.3]] * 4)
    ids = ["x", "x", "y", "y"]
    kw = dict(token_rewards=r, values=v, response_mask=m, group_index=ids, gamma=0.9, lam=0.7,
              norm_by_std=False, baseline_scores=t([0.5] * 4))
    scores = t([1.0, 0.0, 2.0, 5.0])
    expect = {
        "gae": compute_gae_advantages(r, v, m, 0.9, 0.7),
        "grpo": compute_grpo_advantages(scores, m, ids, norm_by_std=False),
        "rloo": compute_rloo_advantages(scores, m, ids),
        "reinforce_plus_plus": compute_reinforce_pp_advantages(r, m, 0.9),
        "reinforce_plus_plus_baseline": compute_reinforce_pp_baseline_advantages(scores, m, ids),
        "remax": compute_remax_advantages(r, t([0.5] * 4), m),
    }
    for name, (a, b) in expect.items():
        got_a, got_b = compute_advantages(name, **kw)
        close(got_a, a)
        close(got_b, b)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="baseline_scores"):
        compute_advantages("remax", token_rewards=r, response_mask=m)


# ----------------------------------------------------------------------------- agg_loss


AGG_LOSS = t([[1.0, 2.0, 3.0, 100.0], [10.0, 5.0, 6.0, 100.0], [7.0, 8.0, 9.0, float("nan")]])
AGG_MASK = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("mode,expect", [
    ("token-mean", 21.0 / 5),
    ("seq-mean-token-sum", (6.0 + 15.0) / 2),  # a fully masked row is left out, as verl 0.9.1
    ("seq-mean-token-mean", (6.0 / (3 + 1e-8) + 15.0 / (2 + 1e-8)) / 2),  # verl's epsilon, exact in fp64
    ("seq-mean-token-sum-norm", (6.0 + 15.0) / 2 / 4),  # mean of row sums / the width
])
def test_agg_loss_modes_with_fully_masked_row(mode, expect):
    x = AGG_LOSS.clone().requires_grad_(True)
    out = agg_loss(x, AGG_MASK, mode)
    close(out, expect)
    out.backward()
    assert torch.isfinite(x.grad).all()
    assert torch.all(x.grad[AGG_MASK == 0] == 0)


def test_agg_loss_norm_divides_by_the_given_constant():
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=16), (6.0 + 15.0) / 2 / 16)
    # a wider (padded) copy of the same batch gives the same loss once the constant is given
    wide_loss = torch.cat([AGG_LOSS, torch.ones(3, 5, dtype=D)], 1)
    wide_mask = torch.cat([AGG_MASK, torch.zeros(3, 5)], 1)
    close(agg_loss(wide_loss, wide_mask, "seq-mean-token-sum-norm", 16), (6.0 + 15.0) / 2 / 16)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_denominator_shares_add_up(mode):
    # micro-batch shares of the normaliser recombine the mini-batch's loss exactly
    loss = torch.randn(7, 5, dtype=D, generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(5)[None] < torch.tensor([3, 0, 5, 1, 0, 2, 4])[:, None]).float()
    parts = [(0, 2), (2, 3), (3, 7)]
    total = sum(algos.agg_loss_denominator(mask[a:b], mode) for a, b in parts)
    total = 1.0 if mode == "token-sum" else total  # token-sum: each part's sum counts whole (share 0 or 1)
    split = sum(algos.agg_loss_denominator(mask[a:b], mode) / total * agg_loss(loss[a:b], mask[a:b], mode, 5)
                for a, b in parts)
    close(split, agg_loss(loss, mask, mode, 5), tol=1e-7)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_all_masked_is_zero(mode):
    out = agg_loss(torch.ones(2, 3, dtype=D), torch.zeros(2, 3), mode)
    close(out, 0.0)


def test_agg_loss_unknown_and_config_modes():
    from hybridrl.config import LOSS_AGG_MODES
    assert tuple(algos.LOSS_AGG_MODES) == tuple(LOSS_AGG_MODES)
    with pytest.raises(ValueError) as e:
        agg_loss(AGG_LOSS, AGG_MASK, "token-total")
    assert "token-total" in str(e.value) and "seq-mean-token-sum-norm" in str(e.value)


# ----------------------------------------------------------------------------- policy loss


def _pg_case():
    # tokens: a) A=+1 r=1.5  b) A=+1 r=0.5  c) A=-1 r=0.5  d) A=-1 r=5  e) A=-2 r=1.1  f) masked
    ratios = t([[1.5, 0.5, 0.5, 5.0, 1.1, 3.0]])
    old = t([[-1.0, -2.0, -0.5, -3.0, -1.5, -1.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0, -2.0, 1.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    return old, old + ratios.log(), adv, mask


def test_policy_loss_dual_clip_by_hand():
    old, lp, adv, mask = _pg_case()
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_loss(old, lp, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    # a: max(-1.5, -1.28) = -1.28 (clipped)   b: max(-0.5, -0.8) = -0.5
    # c: max(0.5, 0.8) = 0.8 (clipped)        d: max(5, 1.28) = 5 -> dual clip min(3, 5) = 3
    # e: 2.2
    close(loss, (-1.28 - 0.5 + 0.8 + 3.0 + 2.2) / 5)
    close(stats["pg_clipfrac"], 2 / 5)
    close(stats["pg_clipfrac_lower"], 1 / 5)
    close(stats["ppo_kl"], -sum(math.log(r) for r in [1.5, 0.5, 0.5, 5.0, 1.1]) / 5)
    for v in stats.values():
        assert v.dim() == 0 and not v.requires_grad
    loss.backward()
    # gradient flows only through unclipped tokens: d(-A r)/dlogp = -A r, over 5 tokens
    close(lp.grad, [[0.0, -0.5 / 5, 0.0, 0.0, 2.2 / 5, 0.0]])


def test_policy_loss_agg_mode_and_clip_c_check():
    old, lp, adv, mask = _pg_case()
    loss, _ = policy_loss(old, lp, adv, mask, clip_high=0.28, agg_mode="seq-mean-token-sum")
    close(loss, -1.28 - 0.5 + 0.8 + 3.0 + 2.2)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(old, lp, adv, mask, clip_c=1.0)


def test_policy_loss_clip_higher_asymmetry():
    ratios = t([[1.25, 0.85, 1.25, 0.85]])
    adv = t([[1.0, -1.0, -1.0, 1.0]])
    old = torch.zeros(1, 4, dtype=D)
    mask = torch.ones(1, 4, dtype=D)
    loss, stats = policy_loss(old, ratios.log(), adv, mask, clip_low=0.1, clip_high=0.3)
    # 1.25 < 1.3: not clipped (-1.25); 0.85 < 0.9 with A<0: clipped to 0.9;
    # A<0 r=1.25: 1.25; A>0 r=0.85: max(-0.85, -0.9) = -0.85
    close(loss, (-1.25 + 0.9 + 1.25 - 0.85) / 4)
    close(stats["pg_clipfrac"], 1 / 4)
    loss_sym, stats_sym = policy_loss(old, ratios.log(), adv, mask, clip_low=0.2, clip_high=0.2)
    # symmetric 0.2: 1.25 clipped to 1.2 for A>0; 0.85 stays (inside [0.8, 1.2])
    close(loss_sym, (-1.2 + 0.85 + 1.25 - 0.85) / 4)
    close(stats_sym["pg_clipfrac"], 1 / 4)


def test_policy_loss_extreme_ratio_is_finite():
    old = t([[0.0, 0.0]])
    lp = t([[50.0, -50.0]])
    loss, stats = policy_loss(old, lp, t([[1.0, -1.0]]), t([[1, 1]]))
    assert torch.isfinite(loss) and torch.isfinite(stats["ppo_kl"])
    close(stats["ppo_kl"], 0.0)  # clamped log-ratios +20 and -20 cancel


def test_policy_loss_truncated_is():
    old = t([[-1.0, -1.0, -1.0]])
    lp = old.clone()  # ratio 1: per-token loss = -A
    adv = t([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3, dtype=D)
    rollout = (old - t([[0.5, 4.0, 1.0]]).log()).requires_grad_(True)  # weights 0.5, 4, 1
    weights, _, _ = algos.compute_rollout_correction_and_rejection_mask(old, rollout, mask, "token", 2.0)
    loss, _ = policy_loss(old, lp, adv, mask, rollout_is_weights=weights)
    close(loss, -(0.5 * 1 + 2.0 * 2 + 1.0 * 3) / 3)  # 4 truncated to 2
    assert not loss.requires_grad  # weights are detached
    plain, _ = policy_loss(old, lp, adv, mask)
    none, _, _ = algos.compute_rollout_correction_and_rejection_mask(old, rollout, mask)  # rollout_is None: off
    assert none is None


# ----------------------------------------------------------------------------- value / entropy


def test_value_loss_by_hand():
    v = t([[1.0, 1.0, 0.2, 50.0]])
    old = t([[0.0, 0.0, 0.0, 0.0]])
    ret = t([[2.0, 0.0, 1.0, 0.0]])
    m = t([[1, 1, 1, 0]])
    loss, clipfrac = value_loss(v, old, ret, m, clip=0.5)
    # tok1: v_clip 0.5 -> max(1, 2.25) clipped; tok2: max(1, 0.25); tok3: 0.64 both
    close(loss, 0.5 * (2.25 + 1.0 + 0.64) / 3)
    close(clipfrac, 1 / 3)
    loss_sum, _ = value_loss(v, old, ret, m, clip=0.5, agg_mode="seq-mean-token-sum")
    close(loss_sum, 0.5 * (2.25 + 1.0 + 0.64))


def test_entropy():
    logits = t([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    ent = entropy_from_logits(logits)
    close(ent[0], math.log(4))
    close(ent[1], 0.0, tol=1e-12)
    close(ent, torch.distributions.Categorical(logits=logits).entropy())
    close(entropy_loss(ent[None, :], t([[1, 0, 1]]), "token-mean"), (math.log(4) + ent[2].item()) / 2)


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    lp = t([0.0, -1.0, -2.0])
    ref = t([-1.0, -1.0, 0.0])
    for kind in ("kl", "k1"):
        close(kl_penalty(lp, ref, kind), [1.0, 0.0, -2.0])
    close(kl_penalty(lp, ref, "abs"), [1.0, 0.0, 2.0])
    for kind in ("mse", "k2"):
        close(kl_penalty(lp, ref, kind), [0.5, 0.0, 2.0])
    # k3 with kl = ref - lp = [-1, 0, 2]: e^kl - kl - 1
    for kind in ("low_var_kl", "k3"):
        close(kl_penalty(lp, ref, kind), [math.exp(-1), 0.0, math.exp(2) - 3])


def test_k3_clamp():
    lp = t([0.0, 0.0, 0.0])
    ref = t([5.0, -30.0, -3.0])
    out = kl_penalty(lp, ref, "k3")
    # e^5 - 6 = 142 -> 10; kl clamped to -20: e^-20 + 19 -> 10; e^-3 + 2 stays
    close(out, [10.0, 10.0, math.exp(-3) + 2.0])


def test_kl_unknown_kind_and_config_kinds():
    from hybridrl.config import KL_KINDS
    assert set(algos.KL_KINDS) == set(KL_KINDS)
    with pytest.raises(ValueError) as e:
        kl_penalty(t([0.0]), t([0.0]), "full")
    assert "full" in str(e.value) and "low_var_kl" in str(e.value)


def test_apply_kl_penalty_by_hand():
    scores = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    ref = torch.zeros(3, 3, dtype=D)
    lp = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 1.0, 1.0]])
    m = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    rewards, kl = apply_kl_penalty(scores, lp, ref, m, kl_coef=0.5, kind="kl")
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 2.0, 0.0], [0.0, 0.0, 0.0]])
    close(kl, (0.2 + 0.4 + 0.0) / 3)  # fully masked row counts as 0


def test_fixed_controller():
    c = make_kl_controller("fixed", 0.3)
    assert isinstance(c, FixedKLController)
    c.update(100.0, 64)
    assert c.value == 0.3


def test_adaptive_controller_by_hand():
    c = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    assert isinstance(c, AdaptiveKLController)
    c.update(0.06, n_steps=10)  # error +0.2 -> x1.02
    assert c.value == pytest.approx(0.1 * 1.02)
    c.update(torch.tensor(1.0), n_steps=10)  # error clipped to +0.2
    assert c.value == pytest.approx(0.1 * 1.02 * 1.02)
    c.update(0.0, n_steps=10)  # error -1 clipped to -0.2 -> x0.98
    assert c.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.98)
    c.update(0.045, n_steps=10)  # error -0.1 -> x0.99
    assert c.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.98 * 0.99)


def test_make_kl_controller_errors():
    with pytest.raises(ValueError, match="pid"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


# ----------------------------------------------------------------------------- dtypes, purity


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_function_keeps_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]).bool()
    fmask = mask.to(dtype)
    ids = [0, 0, 1, 1]
    rew, vals, sc = rnd(B, T), rnd(B, T), rnd(B)
    outs = [
        masked_mean(rew, mask), masked_mean(rew, fmask, dim=-1), masked_var(rew, mask),
        masked_whiten(rew, mask), *compute_gae_advantages(rew, vals, mask, 0.99, 0.95),
        *compute_grpo_advantages(sc, mask, ids), *compute_rloo_advantages(sc, fmask, ids),
        *compute_reinforce_pp_advantages(rew, mask, 0.99),
        *compute_reinforce_pp_baseline_advantages(sc, mask, ids),
        *compute_remax_advantages(rew, sc, fmask), token_rewards_from_scores(sc, mask),
        entropy_from_logits(rnd(B, T, 7)), entropy_loss(rnd(B, T), mask),
        value_loss(vals, rnd(B, T), rnd(B, T), mask)[0], value_loss(vals, vals, rew, mask)[1],
        *apply_kl_penalty(rew, rnd(B, T), rnd(B, T), mask, 0.1, "k3"),
    ]
    outs += [agg_loss(rew, mask, mode) for mode in algos.LOSS_AGG_MODES]
    outs += [kl_penalty(rnd(B, T), rnd(B, T), kind) for kind in algos.KL_KINDS]
    outs += [compute_advantages(n, token_rewards=rew, values=vals, response_mask=mask, group_index=ids,
                                baseline_scores=sc, old_log_probs=-rnd(B, T).abs(), sum_pi_squared=rnd(B, T).abs(),
                                components=[sc, rnd(B)])[0]
             for n in ADV_ESTIMATORS]
    weights, _, _ = algos.compute_rollout_correction_and_rejection_mask(rnd(B, T), rnd(B, T), mask, "token")
    loss, stats = policy_loss(rnd(B, T), rnd(B, T), rnd(B, T), mask, rollout_is_weights=weights)
    outs += [loss, *stats.values()]
    for i, o in enumerate(outs):
        assert o.dtype == dtype, f"output {i} is {o.dtype}"
        assert torch.isfinite(o).all(), f"output {i} not finite"


@pytest.mark.parametrize("module", [algos, algos.masked, algos.rollout_correction], ids=lambda m: m.__name__)
def test_no_torch_distributed(module):
    src = inspect.getsource(module)
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any("distributed" in a.name for a in node.names)
        if isinstance(node, ast.ImportFrom):
            assert "distributed" not in (node.module or "")
            assert not any(a.name == "distributed" for a in node.names)
        if isinstance(node, ast.Attribute):
            assert node.attr != "distributed", ast.unparse(node)
        if isinstance(node, ast.Name):
            assert node.id != "dist"
    assert "dist." not in src


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl", "abs", "k2"])
def test_straight_through_kl_has_the_estimators_value_and_k2s_gradient(kind):
    """verl 0.9.1's kl_penalty with a '+' suffix: forward = the estimator, backward = k2's (d/dlogp of
    0.5 (logp - ref)^2 = logp - ref), by hand."""
    log_prob = torch.tensor([-1.0, -0.5, -2.0, -0.1], requires_grad=True)
    ref = torch.tensor([-1.2, -0.5, -1.0, -0.3])
    plus = algos.kl_penalty(log_prob, ref, kind + "+")
    assert torch.allclose(plus, algos.kl_penalty(log_prob, ref, kind))
    plus.sum().backward()
    assert torch.allclose(log_prob.grad, (log_prob - ref).detach())
    if kind in ("k1", "k3"):  # the plain estimator's gradient is another one
        plain = log_prob.detach().clone().requires_grad_(True)
        algos.kl_penalty(plain, ref, kind).sum().backward()
        assert not torch.allclose(plain.grad, log_prob.grad)
