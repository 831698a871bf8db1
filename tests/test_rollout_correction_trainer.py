"""algorithm.rollout_correction in the trainer (trainer/rollout_correction.py, the actor's loss): one model built,
one step per setting without updating (the same policy and batch each time), the engine's log-probs lowered
by log 2 (even rows) and log 4 (odd rows) so the trainer's are 2x / 4x the engine's.

Decoupled mode: token IS truncated at 3 weighs the policy loss 2 and 3 by row; seq_mean_k1 in [0.4, 0.6]
rejects the odd rows (mask replaced, their advantages 0, GAE and the other estimators alike); the metrics
carry verl's names. Bypass mode (REINFORCE): the weights come from inside the loss. Also: which distribution
the engine's and the trainer's log-probs are of, and the refusals of check_rollout_correction."""
import dataclasses
import math
import types

import pytest
import torch

from dist_helper import run_distributed
from test_trainer_passes import TINY, _overrides

RC = "algorithm.rollout_correction."
BASE = ["actor.loss_agg_mode=seq-mean-token-mean", "critic.loss_agg_mode=seq-mean-token-mean"]
SETTINGS = {
    "metrics_only": [],
    "token_tis": [RC + "rollout_is=token", RC + "rollout_is_threshold=3.0"],
    "seq_mean_k1": [RC + "rollout_rs=seq_mean_k1", RC + "rollout_rs_threshold=0.4_0.6"],
    "bypass_pg": [RC + "bypass_mode=true", RC + "loss_type=reinforce"],
    "bypass_pg_is": [RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=token"],
}
KEPT = ("response_mask", "rollout_is_weights", "advantages", "rollout_log_probs")


def _lowered(assemble):
    """assemble_batch with the engine's log-probs log 2 (even rows) / log 4 (odd rows) below the trainer's."""
    def wrapped(*args, **kwargs):
        batch = assemble(*args, **kwargs)
        rows = torch.arange(batch["response_mask"].shape[0])
        shift = torch.where(rows % 2 == 0, math.log(2.0), math.log(4.0))[:, None]
        batch["rollout_log_probs"] = batch["rollout_log_probs"] - shift * batch["response_mask"]
        return batch
    return wrapped


def _steps(tmp):
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.loop import setup_run
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.roles import build_roles

    cfg = load_config(TINY, _overrides(tmp, BASE))
    _, tok, layout, groups, loader, _ = setup_run(cfg)
    prompts, roles = next(iter(loader)), build_roles(cfg, groups, tok, 4)
    out, synced = {}, False
    for name, extra in SETTINGS.items():
        trainer = PPOTrainer(load_config(TINY, _overrides(tmp, BASE + extra)), layout, groups, tok, roles,
                             RewardManager(cfg.reward), None)
        if not synced:
            trainer.sync_rollout_weights()
            synced = True
        trainer.assemble_batch = _lowered(trainer.assemble_batch)
        seen, update = {}, roles.actor.update_policy
        advantages = trainer.compute_advantages

        def spy_update(batch, *args, **kwargs):
            seen.update({k: batch[k].clone() for k in KEPT if k in batch})
            return update(batch, *args, **kwargs)

        def spy_advantages(batch, scores):
            seen["before"] = ({k: v.clone() for k, v in batch.items()}, scores.clone())
            return advantages(batch, scores)

        roles.actor.update_policy, trainer.compute_advantages = spy_update, spy_advantages
        metrics = trainer.train_step(prompts, 1, update=False)
        del roles.actor.update_policy
        out[name] = dict(metrics=metrics, seen=seen, source=trainer.old_log_prob_source)
    before = out["seq_mean_k1"]["seen"]["before"]
    out["estimators"] = _estimators(tmp, before, layout, groups, tok, roles)
    out["kl_estimators"] = _estimators(tmp, before, layout, groups, tok, roles, KL_IN_REWARD)
    return out


KL_IN_REWARD = ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=fixed",
                "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.norm_adv_by_std_in_grpo=true"]
REF_SHIFT = 0.1
"""With KL_IN_REWARD the reference log-probs are old - REF_SHIFT * (row + 1) on every token: row r's k1 KL."""


def _estimators(tmp, before, layout, groups, tok, roles, extra=()):
    """Every other advantage estimator (GAE is the runs' own) after seq_mean_k1's rejection, from the same
    batch: (advantages, mask)."""
    from hybridrl.algos import ADV_ESTIMATORS
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.ppo import PPOTrainer

    out = {}
    for name in (n for n in ADV_ESTIMATORS if n != "gae"):
        gdpo = ["algorithm.gdpo_reward_keys=[copy]"] if name == "gdpo" else []  # one component (below)
        cfg = load_config(TINY, _overrides(tmp, BASE + SETTINGS["seq_mean_k1"] + [f"algorithm.adv_estimator={name}"]
                                           + gdpo + list(extra)))
        trainer = PPOTrainer(cfg, layout, groups, tok, dataclasses.replace(roles, critic=None), RewardManager(cfg.reward),
                             None)
        batch, scores = {k: v.clone() for k, v in before[0].items()}, before[1].clone()
        batch["baseline_scores"] = torch.zeros_like(scores)  # ReMax's greedy scores
        batch["sum_pi_squared"] = torch.full_like(batch["old_log_probs"], 0.25)  # the optimal token baselines'
        rows = torch.arange(scores.shape[0], dtype=batch["old_log_probs"].dtype)[:, None] + 1
        batch["reward_component/copy"] = scores + rows[:, 0]  # GDPO's component: untied within every group
        batch["ref_log_probs"] = batch["old_log_probs"] - REF_SHIFT * rows
        trainer.compute_advantages(batch, scores)
        out[name] = (batch["advantages"], batch["response_mask"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_steps, 1, str(tmp_path_factory.mktemp("rollout_correction")))[0]


def _odd_rows_zeroed(mask):
    out = mask.clone()
    out[1::2] = 0
    return out


def test_metrics_have_verls_names_and_measure_the_gap(runs):
    plain = runs["metrics_only"]
    assert plain["source"] == "update"  # nothing to correct: no separate old-log-prob pass
    mask = plain["seen"]["response_mask"]
    shift = torch.where(torch.arange(mask.shape[0]) % 2 == 0, math.log(2.0), math.log(4.0))[:, None]
    m = plain["metrics"]
    assert m["rollout_corr/kl"] == pytest.approx(-(shift * mask).sum().item() / mask.sum().item(), abs=1e-4)
    for key in ("rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "rollout_corr/ppl_ratio",
                "rollout_corr/chi2_token", "rollout_corr/chi2_seq", "training/rollout_probs_diff_mean",
                "training/rollout_probs_diff_max", "training/rollout_probs_diff_std",
                "training/rollout_actor_probs_pearson_corr"):
        assert math.isfinite(m[key]), key
    assert not any(k.startswith("rollout_corr/rollout_is") for k in m)
    assert runs["token_tis"]["source"] == "pass" and runs["seq_mean_k1"]["source"] == "pass"


def test_token_is_weights_reach_the_policy_loss(runs):
    """Ratio 1 (no update): the loss is seq-mean-token-mean of -A * w, w = 2 (even rows) and 4 cut at 3 (odd)."""
    plain, tis = runs["metrics_only"], runs["token_tis"]
    mask, adv = tis["seen"]["response_mask"], tis["seen"]["advantages"]
    weights = torch.where(torch.arange(mask.shape[0]) % 2 == 0, 2.0, 3.0)[:, None] * mask
    torch.testing.assert_close(tis["seen"]["rollout_is_weights"], weights, atol=1e-5, rtol=0)
    assert "rollout_is_weights" not in plain["seen"]
    expect = (-(adv * weights).sum(-1) / mask.sum(-1)).mean().item()
    assert abs(expect) > 1e-3
    assert tis["metrics"]["actor/pg_loss"] == pytest.approx(expect, rel=1e-4)
    assert plain["metrics"]["actor/pg_loss"] == pytest.approx((-adv.sum(-1) / mask.sum(-1)).mean().item(), abs=1e-6)
    assert tis["metrics"]["critic/vf_loss"] == pytest.approx(plain["metrics"]["critic/vf_loss"], rel=1e-5)
    assert tis["metrics"]["rollout_corr/rollout_is_mean"] == pytest.approx(weights.sum().item() / mask.sum().item(),
                                                                          abs=1e-5)
    assert tis["metrics"]["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(
        mask[1::2].sum().item() / mask.sum().item(), abs=1e-6)  # the 4x rows


def test_rejection_replaces_the_mask_before_the_advantages(runs):
    rs, plain = runs["seq_mean_k1"], runs["metrics_only"]
    mask = plain["seen"]["response_mask"]
    torch.testing.assert_close(rs["seen"]["response_mask"], _odd_rows_zeroed(mask))
    assert (rs["seen"]["advantages"][1::2] == 0).all() and (rs["seen"]["advantages"][0::2] != 0).any()
    m = rs["metrics"]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(mask[1::2].sum().item() / mask.sum().item())
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert "rollout_is_weights" not in rs["seen"]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_rows_rejection_masked_out_count_in_the_seq_mean_normaliser(mode):
    """verl's trainer divides the seq-mean modes by every row of the mini-batch (global_batch_size =
    ppo_mini_batch_size x n), rows masked out entirely by rejection sampling included, and token-mean by the
    loss tokens. A mini-batch of 8 rows in 3 micro-batches, 3 rows masked out: the share-weighted micro-batch
    losses (workers/update.py) against verl's formula by hand (before: the seq-mean modes over the 5 kept rows)."""
    from hybridrl import algos
    from hybridrl.workers.update import global_weights

    g = torch.Generator().manual_seed(0)
    loss = torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    mask[[1, 4, 6]] = 0.0
    cuts = ((0, 3), (3, 5), (5, 8))
    engine = types.SimpleNamespace(groups=types.SimpleNamespace(dp=1))
    shares = global_weights([{"response_mask": mask[a:b]} for a, b in cuts], mode, engine)
    got = sum(w * algos.agg_loss(loss[a:b], mask[a:b], mode, loss_scale_factor=5.0) for w, (a, b) in zip(shares, cuts))
    row_sums = (loss * mask).sum(-1)
    expect = {"token-mean": row_sums.sum() / mask.sum(),
              "seq-mean-token-sum": row_sums.sum() / 8,
              "seq-mean-token-mean": (row_sums / mask.sum(-1).clamp(min=1)).sum() / 8,
              "seq-mean-token-sum-norm": row_sums.sum() / 8 / 5.0}[mode]
    assert float(got) == pytest.approx(float(expect), rel=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                                       "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"])
def test_every_estimator_sees_the_rejected_mask(runs, estimator):
    advantages, mask = runs["estimators"][estimator]
    before = runs["seq_mean_k1"]["seen"]["before"][0]["response_mask"]
    torch.testing.assert_close(mask, _odd_rows_zeroed(before))
    assert (advantages[1::2] == 0).all()
    assert (advantages * (1 - mask) == 0).all()
    if estimator == "gdpo":  # its component is untied: a kept row learns, so the zeros above are the mask's
        assert (advantages[0::2] != 0).any(-1).all(), advantages[0::2]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_see_the_kl_penalty_in_the_reward(runs, estimator):
    """verl sums each row's token rewards (score - coef * KL over the mask from before the rejection) for the
    outcome estimators; by hand here: GRPO over groups of rollout.n = 2 (unbiased std + 1e-6), RLOO against the
    other sample. Before the fix these took the raw scores, penalty left out (ties gave advantage 0)."""
    batch, scores = runs["seq_mean_k1"]["seen"]["before"]
    before = batch["response_mask"]
    rows = torch.arange(scores.shape[0], dtype=torch.float32) + 1
    penalised = (scores - 0.5 * REF_SHIFT * rows * before.sum(-1)).view(-1, 2)
    if estimator == "grpo":
        expect = (penalised - penalised.mean(-1, keepdim=True)) / (penalised.std(-1, keepdim=True) + 1e-6)
    else:
        expect = penalised - penalised.flip(-1)
    advantages, mask = runs["kl_estimators"][estimator]
    torch.testing.assert_close(advantages, expect.view(-1, 1) * mask, atol=1e-4, rtol=1e-4)
    assert (advantages[0::2].abs() > 1e-3).all()  # every kept row learns, tied scores or not
    plain, _ = runs["estimators"][estimator]
    assert not torch.allclose(plain, advantages)


def test_bypass_mode_corrects_inside_the_loss(runs):
    pg, pg_is = runs["bypass_pg"], runs["bypass_pg_is"]
    assert pg["source"] == pg_is["source"] == "rollout" and abs(pg["metrics"]["actor/pg_loss"]) > 1e-3
    assert "timing_s/old_log_prob" not in pg_is["metrics"]
    assert pg_is["metrics"]["actor/pg_loss"] == pytest.approx(2.0 * pg["metrics"]["actor/pg_loss"], rel=1e-4)
    assert pg_is["metrics"]["rollout_corr/rollout_is_mean"] == pytest.approx(2.0, abs=1e-5)
    assert "actor/pg_clipfrac" not in pg_is["metrics"]  # REINFORCE: no ratio, no clip
    assert pg["metrics"]["rollout_corr/kl"] == pytest.approx(runs["metrics_only"]["metrics"]["rollout_corr/kl"],
                                                             abs=1e-4)


def test_engine_and_trainer_log_probs_are_one_distribution():
    """log_softmax(logits / T) over the full vocabulary at the sampled token, top-k / top-p on: the native
    engine reports it, the trainer computes it, and it is not the truncated distribution's."""
    from hybridrl.models.logprobs import vocab_parallel_token_stats
    from hybridrl.rollout.base import SamplingParams, filter_top_k_top_p, row_keys, sample_next

    g = torch.Generator().manual_seed(4)
    logits = 3.0 * torch.randn(64, 50, generator=g)
    for sampling in (SamplingParams(temperature=0.7, top_k=8, top_p=0.8), SamplingParams(temperature=0.0)):
        tokens, engine = sample_next(logits, sampling, row_keys(list(range(64)), "cpu"), torch.zeros(64).long())
        t = sampling.temperature or 1.0  # greedy: the trainer's temperature is 1 (workers/actor.py)
        trainer, _ = vocab_parallel_token_stats(logits, tokens, None, 50, t, False)
        torch.testing.assert_close(engine, trainer, atol=1e-6, rtol=0)
        torch.testing.assert_close(engine, torch.log_softmax(logits / t, -1).gather(-1, tokens[:, None])[:, 0])
    tokens, engine = sample_next(logits, SamplingParams(temperature=0.7, top_k=8, top_p=0.8),
                                 row_keys(list(range(64)), "cpu"), torch.zeros(64).long())
    truncated = torch.log_softmax(filter_top_k_top_p(logits / 0.7, 8, 0.8), -1).gather(-1, tokens[:, None])[:, 0]
    assert (truncated - engine > 1e-3).all()


def _cfg(extra):
    from hybridrl.config.io import load_config

    return load_config(TINY, extra)


@pytest.mark.parametrize("extra,engine,fragment", [
    (["rollout.top_p=0.9", RC + "rollout_is=token"], "processed_logprobs", "truncated distribution"),
    (["rollout.top_k=20", RC + "bypass_mode=true"], "processed_logprobs", "truncated distribution"),
    (["rollout.temperature=0.7", RC + "rollout_rs=seq_mean_k3", RC + "rollout_rs_threshold=0.01"], "raw_logprobs",
     "before temperature"),
    ([RC + "bypass_mode=true", RC + "loss_type=reinforce", "actor.policy_loss.loss_mode=gspo"], None, "reinforce"),
])
def test_refused_where_the_loss_would_use_another_distribution(extra, engine, fragment):
    from hybridrl.config import ConfigError
    from hybridrl.trainer.rollout_correction import check_rollout_correction

    cfg = _cfg(["rollout.name=vllm"] + extra)
    with pytest.raises(ConfigError, match=fragment):
        check_rollout_correction(cfg, types.SimpleNamespace(logprobs_mode=engine))


@pytest.mark.parametrize("extra", [["rollout.top_p=0.9"], [RC + "rollout_is=token"],
                                   ["rollout.temperature=0.7", RC + "rollout_is=token"]])
def test_allowed_where_the_distributions_agree_or_only_metrics_use_them(extra):
    from hybridrl.trainer.rollout_correction import check_rollout_correction

    check_rollout_correction(_cfg(["rollout.name=vllm"] + extra), types.SimpleNamespace(logprobs_mode="processed_logprobs"))
