"""Every loss_agg_mode (and GSPO's sequence-level loss) gives the same update at 1, 2 and 4 micro-batches
and at DP 1 and 2.

One actor update (policy loss + entropy bonus + KL loss) and one critic update per mode and split,
from the same weights and on the same 8-row mini-batch (one row fully masked). Adam with eps=1 and
no clipping is close to SGD, so parameters after the step follow the gradient's scale, not only its
sign. References: the single micro-batch run at DP=1, and the losses `algos` computes on the whole
mini-batch with log-probs taken before the update (the seq-mean modes over all 8 rows, as verl's trainer). A copy of the batch trimmed to its longest
response must give the same seq-mean-token-sum-norm update (the divisor is a constant).
"""
import functools

import pytest
import torch

from dist_helper import run_distributed
from models_helper import padded_rl_rows

B, P, R = 8, 5, 6
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "gspo",
         "cispo", "gpg", "dro", "geo_mean", "sapo", "dppo_tv", "dppo_kl")
LOSSES = {"gspo": "seq-mean-token-mean", "cispo": "token-mean", "gpg": "seq-mean-token-sum", "dro": "token-mean",
          "geo_mean": "token-mean", "sapo": "seq-mean-token-sum", "dppo_tv": "token-mean", "dppo_kl": "seq-mean-token-mean"}
"""Policy losses other than vanilla, each with an aggregation (GMPO's and SAPO's policy terms keep their own mean
over responses while their entropy and KL terms take the aggregation given)."""
OWN_MEAN = ("geo_mean", "sapo")
DRO_BETA = 0.5


def _modes(mode):
    """(actor.policy_loss.loss_mode, loss_agg_mode) of a case: a loss of LOSSES with its aggregation, or vanilla."""
    return (mode, LOSSES[mode]) if mode in LOSSES else ("vanilla", mode)


def _batch(vocab):
    g = torch.Generator().manual_seed(7)
    # row 2: no loss token; column 5: padding only
    batch = padded_rl_rows(vocab, [5, 3, 4, 5, 2, 5, 4, 3], [4, 1, 0, 4, 3, 2, 4, 1], (P, R), g)
    rmask = batch["response_mask"]
    return {**batch, "old_log_probs": (-3.0 + 0.3 * torch.randn(B, R, generator=g)) * rmask,
            "ref_log_probs": (-3.0 + 0.3 * torch.randn(B, R, generator=g)) * rmask,
            "advantages": torch.randn(B, 1, generator=g) * rmask,
            "values": torch.randn(B, R, generator=g) * rmask, "returns": torch.randn(B, R, generator=g) * rmask}


def _trimmed(batch, width):
    """The batch with its trailing response columns cut (what dynamic batching may hand a worker)."""
    cut = R - width
    return {k: v[:, :v.shape[1] - cut] if k in ("input_ids", "attention_mask") or v.shape[1] == R else v
            for k, v in batch.items()}


def _update(folder, groups, batch, mode, micro):
    from hybridrl.config import ActorConfig, Config, CriticConfig, OptimConfig, PolicyLossConfig
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.actor import ActorWorker
    from hybridrl.workers.critic import CriticWorker
    from hybridrl.workers.engine import ModelEngine
    from hybridrl.config.batching import MicroBatching
    from hybridrl.workers.optim import build_optimizer

    loss_mode, mode = _modes(mode)
    optim = OptimConfig(lr=1e-2, eps=1.0, clip_grad=0.0)
    acfg = ActorConfig(optim=optim, ppo_micro_batch_size_per_gpu=micro, loss_agg_mode=mode, entropy_coeff=0.01,
                       use_kl_loss=True, kl_loss_coef=0.1,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=DRO_BETA if loss_mode == "dro" else None))
    ccfg = Config(critic=CriticConfig(optim=optim, ppo_micro_batch_size_per_gpu=micro, loss_agg_mode=mode)).critic
    model, spec = model_from_hf(folder, groups)
    module = wrap_trainable(model, Config())
    actor = ActorWorker(ModelEngine(module, groups), build_optimizer(module, optim, groups, 10), acfg,
                        spec.vocab_size, temperature=1.0, max_response_length=R)
    cmodel, _, _ = critic_from_hf(folder, groups, seed=5)
    cmodule = wrap_trainable(cmodel, Config())
    critic = CriticWorker(ModelEngine(cmodule, groups), build_optimizer(cmodule, optim, groups, 10), ccfg,
                          max_response_length=R)
    rows = batch["responses"].shape[0]
    log_probs, entropy = actor.compute_log_prob(batch, MicroBatching(rows), with_entropy=True)
    out = {"actor": actor.update_policy(batch, rows, MicroBatching(micro)),
           "critic": critic.update_critic(batch, rows, MicroBatching(micro)),
           "log_probs": log_probs, "entropy": entropy}
    out["params"] = {f"actor.{n}": p.detach().clone() for n, p in module.named_parameters()}
    out["params"].update({f"critic.{n}": p.detach().clone() for n, p in cmodule.named_parameters()})
    return out


def _run_all(folder, micro_sizes):
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.step_batch import local_slice

    groups = init_model_parallel(1, 1)
    full = _batch(97)
    batch = {k: local_slice(v, groups) for k, v in full.items()}
    out = {(mode, micro): _update(folder, groups, batch, mode, micro) for mode in MODES for micro in micro_sizes}
    if groups.dp == 1:
        width = int(full["response_mask"].sum(-1).max())
        out[("seq-mean-token-sum-norm", "trimmed")] = _update(folder, groups, _trimmed(batch, width),
                                                               "seq-mean-token-sum-norm", B)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path_factory.mktemp("hf") / "qwen2"), "qwen2", seed=1,
                                    num_hidden_layers=1, vocab_size=97)
    dp1 = run_distributed(_run_all, 1, folder, (B, B // 2, B // 4))[0]
    dp2 = run_distributed(_run_all, 2, folder, (B // 2, B // 4, B // 8))[0]
    return dp1, dp2


def _same_params(got, ref, what):
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, atol=2e-7, rtol=1e-5, msg=lambda m: f"{what} {name}: {m}")


def _expected_losses(ref, mode):
    from hybridrl import algos

    b = _batch(97)
    mask = b["response_mask"]
    loss_mode, mode = _modes(mode)
    from hybridrl.algos import token_losses

    loss_fn = {"gspo": functools.partial(algos.gspo_policy_loss, clip_low=0.2, clip_high=0.2),
               "cispo": functools.partial(token_losses.cispo_policy_loss, clip_low=0.2, clip_high=0.2),
               "gpg": token_losses.gpg_policy_loss, "dro": functools.partial(token_losses.dro_policy_loss, beta=DRO_BETA),
               "geo_mean": functools.partial(token_losses.geo_mean_policy_loss, clip_low=0.2, clip_high=0.2),
               "sapo": token_losses.sapo_policy_loss,  # the actor's default temperatures, 1.0 / 1.05
               "dppo_tv": functools.partial(token_losses.dppo_tv_policy_loss, clip_low=0.2, clip_high=0.2, clip_c=3.0),
               "dppo_kl": functools.partial(token_losses.dppo_kl_policy_loss, clip_low=0.2, clip_high=0.2, clip_c=3.0),
               "vanilla": functools.partial(algos.policy_loss, clip_low=0.2, clip_high=0.2)}[loss_mode]
    pg, _ = loss_fn(b["old_log_probs"], ref["log_probs"], b["advantages"], mask, agg_mode=mode, loss_scale_factor=R)
    kl = algos.agg_loss(algos.kl_penalty(ref["log_probs"], b["ref_log_probs"], "low_var_kl"), mask, mode, R)
    # agg_loss of one batch leaves the row without a loss token out of the seq-mean; verl's trainer divides by
    # every row of the mini-batch (its global_batch_size)
    rows = float((mask.sum(-1) > 0).sum()) / B
    scale = 1.0 if mode in ("token-mean", "token-sum") else rows
    return {"actor/pg_loss": pg.item() * (rows if loss_mode in OWN_MEAN else scale), "actor/kl_loss": kl.item() * scale,
            "actor/entropy_loss": algos.agg_loss(ref["entropy"], mask, mode, R).item() * scale}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_update_is_split_and_dp_invariant(runs, mode):
    dp1, dp2 = runs
    ref = dp1[(mode, B)]
    for key, value in _expected_losses(ref, mode).items():  # the mini-batch's own agg_loss
        assert abs(ref["actor"][key] - value) <= 1e-5 * max(1.0, abs(value)), (key, ref["actor"][key], value)
    cases = [(f"dp1 micro={m}", dp1[(mode, m)]) for m in (B // 2, B // 4)]
    cases += [(f"dp2 micro={m}", dp2[(mode, m)]) for m in (B // 2, B // 4, B // 8)]
    for what, got in cases:
        _same_params(got, ref, what)
        for role in ("actor", "critic"):
            for key in (f"{role}/grad_norm", "actor/pg_loss", "critic/vf_loss"):
                if key in ref[role]:
                    assert abs(got[role][key] - ref[role][key]) <= 1e-5 * max(1.0, abs(ref[role][key])), (what, key)
    assert ref["actor"]["actor/grad_norm"] > 0 and ref["critic"]["critic/grad_norm"] > 0


@pytest.mark.distributed
def test_token_sum_is_token_mean_times_the_mini_batchs_tokens(runs):
    """verl's token-sum: the loss (policy, entropy and KL terms alike) is the sum over every loss token of the
    mini-batch, so its gradient is token-mean's times their count, at DP 1 and 2 and any split."""
    dp1, dp2 = runs
    tokens = float(_batch(97)["response_mask"].sum())
    for run in (dp1, dp2):
        for (mode, micro), got in run.items():
            if mode == "token-sum":
                mean = run[("token-mean", micro)]["actor"]
                assert got["actor"]["actor/grad_norm"] == pytest.approx(tokens * mean["actor/grad_norm"], rel=1e-5)
                assert got["actor"]["actor/pg_loss"] == pytest.approx(tokens * mean["actor/pg_loss"], rel=1e-5)


@pytest.mark.distributed
def test_sum_norm_divides_by_the_configured_length_not_the_batch_width(runs):
    dp1, _ = runs
    ref, trimmed = dp1[("seq-mean-token-sum-norm", B)], dp1[("seq-mean-token-sum-norm", "trimmed")]
    _same_params(trimmed, ref, "trimmed batch")
    assert abs(trimmed["actor"]["actor/pg_loss"] - ref["actor"]["actor/pg_loss"]) <= 1e-6
