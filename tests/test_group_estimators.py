"""verl 0.9.1's grpo_passk, opo and gpg advantage estimators and its cispo, gpg and dro policy losses, by hand."""
import pytest
import torch

from hybridrl import algos
from hybridrl.algos import token_losses

SCORES = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0, 5.0])
GROUPS = [0, 0, 0, 1, 1, 1]
MASK = torch.ones(6, 3)
MASK[1, 2:] = 0  # row 1 has 2 loss tokens


def _adv(name, **kw):
    adv, returns = algos.compute_advantages(name, scores=SCORES, response_mask=MASK, group_index=GROUPS, **kw)
    assert torch.equal(adv, returns) and torch.equal(adv * MASK, adv)
    return adv[:, 0]


def test_passk_gives_the_best_its_margin_over_the_second():
    std0 = torch.tensor([1.0, 0.0, 3.0]).std()  # unbiased, as torch.std
    assert _adv("grpo_passk").tolist() == pytest.approx([0, 0, 2 / (std0.item() + 1e-6), 0, 0, 0])
    assert _adv("grpo_passk", norm_by_std=False).tolist() == [0, 0, 2, 0, 0, 0]  # tied best: margin 0
    with pytest.raises(ValueError, match="at least 2 responses"):
        algos.compute_advantages("grpo_passk", scores=SCORES[:3], response_mask=MASK[:3], group_index=[0, 1, 1])


def test_opo_subtracts_the_length_weighted_group_mean():
    # group 0: lengths 3, 2, 3 -> (3*1 + 2*0 + 3*3) / 8 = 1.5; group 1: equal lengths -> 4
    assert _adv("opo").tolist() == pytest.approx([-0.5, -1.5, 1.5, -2.0, 1.0, 1.0])
    single, _ = algos.compute_advantages("opo", scores=SCORES[:2], response_mask=MASK[:2], group_index=[0, 1])
    assert single[:, 0].tolist() == [1.0, 0.0]  # a lone response has baseline 0


def test_gpg_scales_by_the_share_of_nonzero_scores():
    alpha = 6 / 5  # one of six scores is 0
    want = [alpha * (s - m) for s, m in zip(SCORES.tolist(), [4 / 3] * 3 + [4.0] * 3)]
    assert _adv("gpg").tolist() == pytest.approx(want)


def _grad(loss_fn, **kw):
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    log_prob = torch.tensor([[-0.5, -2.0], [-1.5, -1.4]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    loss, stats = loss_fn(old, log_prob, adv, torch.ones(2, 2), agg_mode="token-mean", **kw)
    loss.backward()
    return loss, log_prob.grad, stats, (log_prob - old).detach(), adv


def test_cispo_weights_the_gradient_by_the_clipped_ratio_held_constant():
    loss, grad, stats, log_ratio, adv = _grad(token_losses.cispo_policy_loss, clip_low=0.2, clip_high=0.28)
    weight = log_ratio.exp().clamp(0.8, 1.28)
    assert torch.allclose(grad, -weight * adv / 4)  # every token keeps a gradient, clipped or not
    assert stats["pg_clipfrac"].item() == pytest.approx((log_ratio.exp() != weight).float().mean().item())


def test_gpg_and_dro_gradients():
    _, grad, stats, _, adv = _grad(token_losses.gpg_policy_loss)
    assert torch.allclose(grad, -adv / 4) and stats == {}
    _, grad, stats, log_ratio, adv = _grad(token_losses.dro_policy_loss, beta=0.5)
    assert torch.allclose(grad, -(adv - 0.5 * log_ratio) / 4)
    assert stats["ppo_kl"].item() == pytest.approx(-log_ratio.mean().item())
    with pytest.raises(ValueError, match="dro_beta > 0"):
        _grad(token_losses.dro_policy_loss, beta=0.0)


def test_config_reads_the_new_names():
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config

    cfg = load_config("", ["algorithm.adv_estimator=opo", "actor.policy_loss.loss_mode=cispo"])
    assert (cfg.algorithm.adv_estimator, cfg.actor.policy_loss.loss_mode) == ("opo", "cispo")
    with pytest.raises(ConfigError, match="set rollout.n >= 2"):
        load_config("", ["algorithm.adv_estimator=grpo_passk", "rollout.n=1"])


def test_actor_config_picks_each_loss_with_its_settings():
    from hybridrl.algos import covariance_losses
    from hybridrl.config.io import load_config
    from hybridrl.workers.actor import _policy_agg, _surrogate

    def actor(*keys):
        return load_config("", list(keys)).actor

    a = actor("actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.01",
              "actor.policy_loss.clip_cov_ub=4", "actor.clip_ratio_high=0.3")
    fn = _surrogate(a)
    assert fn.func is covariance_losses.clip_cov_policy_loss
    assert fn.keywords == dict(cov_ratio=0.01, cov_lb=1.0, cov_ub=4.0, clip_low=0.2, clip_high=0.3)
    fn = _surrogate(actor("actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.ppo_kl_coef=0.5"))
    assert fn.func is covariance_losses.kl_cov_policy_loss and fn.keywords == dict(cov_ratio=0.0002, kl_coef=0.5)
    geo = actor("actor.policy_loss.loss_mode=geo_mean", "actor.loss_agg_mode=token-mean")
    assert _surrogate(geo).func is token_losses.geo_mean_policy_loss and _policy_agg(geo) == "seq-mean-token-mean"
    assert _policy_agg(actor("actor.loss_agg_mode=token-sum")) == "token-sum"


def test_gmpo_in_bypass_mode_counts_rejected_rows_not_tokens():
    """Bypass mode's rejection rescales the policy term by what is left of its normaliser: rows for GMPO (its
    mean is over responses), not the loss_agg_mode's tokens. A token rejected inside a row that keeps others
    leaves GMPO's rows, so its loss is the function's on the kept mask (it was cut by the share of tokens)."""
    from types import SimpleNamespace

    from hybridrl.config import RolloutCorrectionConfig
    from hybridrl.config.io import load_config
    from hybridrl.workers.actor import ActorWorker, _surrogate

    cfg = load_config("", ["actor.policy_loss.loss_mode=geo_mean", "actor.loss_agg_mode=token-mean"]).actor
    bypass = RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip", rollout_rs="token_k1",
                                     rollout_rs_threshold="0.5_2.0")
    worker = SimpleNamespace(cfg=cfg, bypass=bypass, loss_scale_factor=4)
    rollout = torch.full((2, 4), -1.0)
    log_prob = rollout.clone()
    log_prob[0, 1] = 0.0  # ratio e: outside [0.5, 2], rejected; the rest of row 0 and row 1 stay
    adv = torch.tensor([[1.0] * 4, [-0.5] * 4])
    mask = torch.ones(2, 4)
    loss, _, _ = ActorWorker._policy_loss(worker, {"response_mask": mask, "advantages": adv}, log_prob, rollout)
    kept = mask.clone()
    kept[0, 1] = 0
    want, _ = _surrogate(cfg)(rollout, log_prob, adv, kept)
    assert loss.item() == pytest.approx(want.item())
