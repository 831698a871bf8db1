"""Several optimizer steps per batch: ppo_epochs 2 over 2 mini-batches (4 steps, 2 micro-batches each)
against a plain torch PPO loop over transformers' model with torch's AdamW. After the first step the
policy is no longer the one that sampled, so the ratio moves off 1 and the clip engages: per step the
losses, clip fractions, ppo_kl, entropy, KL loss and grad norm must match, their reported values must be
the mean over the steps, and the final weights must be the reference's. The critic likewise: its value
clip engages once its values have moved off the old ones."""
import pytest
import torch

from dist_helper import run_distributed
from models_helper import padded_rl_rows

B, P, R = 8, 6, 5
MINI, EPOCHS, TEMPERATURE = 4, 2, 0.7
LOW, HIGH, DUAL, ENT, KL = 0.1, 0.15, 3.0, 0.01, 0.1
# eps 1e-3 keeps each Adam step a faithful image of the gradient (see test_workers); the rest is the default
LR, EPS, CLIP_GRAD = 1e-2, 1e-3, 1.0
STATS = ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss", "grad_norm")
VALUE_CLIP, CRITIC_LR = 0.05, 2e-3
CRITIC_STATS = ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    return random_hf_model_folder(str(tmp_path_factory.mktemp("hf") / "qwen2"), "qwen2", seed=0,
                                  num_hidden_layers=2, vocab_size=97)


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    """A reward-model folder: the critic starts from its trunk and its score head."""
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    return random_hf_model_folder(str(tmp_path_factory.mktemp("rm") / "qwen2"), "qwen2", seed=1, head="score",
                                  num_hidden_layers=2, vocab_size=97)


def _hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")


def _token_stats(model, batch, rows):
    """Log-probs of the responses and entropy under softmax(logits / T), transformers' forward."""
    mask = batch["attention_mask"][rows]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch["input_ids"][rows], attention_mask=mask.long(), position_ids=pos).logits
    logp = torch.log_softmax(logits[:, P - 1:-1] / TEMPERATURE, -1)
    return logp.gather(-1, batch["responses"][rows][..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _batch(folder, rm_folder):
    import transformers

    g = torch.Generator().manual_seed(7)
    batch = padded_rl_rows(97, [6, 4, 5, 6, 3, 6, 2, 5], [5, 3, 1, 5, 4, 2, 5, 3], (P, R), g)
    mask = batch["response_mask"]
    critic = transformers.AutoModelForSequenceClassification.from_pretrained(rm_folder, dtype=torch.float32)
    with torch.no_grad():  # the sampling policy is the model itself (the first step's ratio is 1), and
        old, _ = _token_stats(_hf_model(folder), batch, slice(None))  # the old values are the critic's own
        values = _values(critic, 0.0, batch, slice(None))
    return {**batch, "old_log_probs": old * mask, "advantages": torch.randn(B, R, generator=g) * mask,
            "ref_log_probs": (old + 0.2 * torch.randn(B, R, generator=g)) * mask, "values": values * mask,
            "returns": (values + 0.3 * torch.randn(B, R, generator=g)) * mask}


def _optimizer_steps(batch):
    """(rows, masked mean over their response tokens) of each optimizer step: consecutive mini-batches, epochs
    over them."""
    for _ in range(EPOCHS):
        for start in range(0, B, MINI):
            rows = slice(start, start + MINI)
            m = batch["response_mask"][rows]
            yield rows, lambda x, m=m: (x * m).sum() / m.sum()


def _reference(folder, batch):
    """The PPO update written out: consecutive mini-batches, epochs over them, one AdamW step each."""
    model = _hf_model(folder).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    steps = []
    for rows, mean in _optimizer_steps(batch):
        lp, ent = _token_stats(model, batch, rows)
        adv, old = batch["advantages"][rows], batch["old_log_probs"][rows]
        ratio = torch.exp(lp - old)
        unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - LOW, 1 + HIGH)
        pg = torch.maximum(unclipped, clipped)
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * DUAL), pg)
        d = (batch["ref_log_probs"][rows] - lp).clamp(-20, 20)  # k3 and its clamps (verl's low_var_kl)
        kl = mean((torch.exp(d) - d - 1).clamp(-10, 10))
        pg_loss, entropy = mean(pg), mean(ent)
        opt.zero_grad()
        (pg_loss - ENT * entropy + KL * kl).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        opt.step()
        steps.append({"pg_loss": pg_loss.item(), "pg_clipfrac": mean((clipped > unclipped).float()).item(),
                      "ppo_kl": mean(old - lp).item(), "entropy_loss": entropy.item(), "kl_loss": kl.item(),
                      "grad_norm": norm.item()})
    return steps, {k: v.detach() for k, v in model.state_dict().items()}


def _values(critic, bias, batch, rows):
    """V(s) before each response token: the score head on every position of transformers' trunk."""
    mask = batch["attention_mask"][rows]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = critic.model(input_ids=batch["input_ids"][rows], attention_mask=mask.long(), position_ids=pos)[0]
    return (critic.score(hidden).squeeze(-1) + bias)[:, P - 1:-1]


def _critic_reference(folder, batch):
    """The clipped value loss, 0.5 * max((v - R)^2, (clip(v, old +- c) - R)^2), over the same steps."""
    import transformers

    critic = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").train()
    bias = torch.nn.Parameter(torch.zeros(1))  # the value head's bias (a score head has none: it starts at 0)
    params = list(critic.parameters()) + [bias]
    opt = torch.optim.AdamW(params, lr=CRITIC_LR, eps=EPS, weight_decay=0.0)
    steps = []
    for rows, mean in _optimizer_steps(batch):
        v, old, ret = _values(critic, bias, batch, rows), batch["values"][rows], batch["returns"][rows]
        v_clipped = torch.maximum(torch.minimum(v, old + VALUE_CLIP), old - VALUE_CLIP)
        unclipped, clipped = (v - ret) ** 2, (v_clipped - ret) ** 2
        loss = 0.5 * mean(torch.maximum(unclipped, clipped))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD)
        opt.step()
        steps.append({"vf_loss": loss.item(), "vf_clipfrac": mean((clipped > unclipped).float()).item(),
                      "vpred_mean": mean(v.detach()).item(), "grad_norm": norm.item()})
    weights = {k: v.detach() for k, v in critic.state_dict().items()}
    return steps, {**weights, "score.bias": bias.detach()}


def _hybridrl(folder, rm_folder, batch):
    """ActorWorker.update_policy and CriticWorker.update_critic with the same settings: the per-step
    metrics they average, what they report, their weights under HF names."""
    from hybridrl.config import ActorConfig, Config, CriticConfig, OptimConfig
    from hybridrl.config.batching import MicroBatching
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers import update
    from hybridrl.workers.actor import ActorWorker
    from hybridrl.workers.critic import CriticWorker
    from hybridrl.workers.engine import ModelEngine
    from hybridrl.workers.optim import build_optimizer

    groups = init_model_parallel(1, 1)
    acfg = ActorConfig(optim=OptimConfig(lr=LR, eps=EPS, clip_grad=CLIP_GRAD, weight_decay=0.0), ppo_epochs=EPOCHS,
                       ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2, clip_ratio_low=LOW,
                       clip_ratio_high=HIGH, clip_ratio_c=DUAL, entropy_coeff=ENT, use_kl_loss=True, kl_loss_coef=KL,
                       kl_loss_type="low_var_kl", loss_agg_mode="token-mean")
    model, spec = model_from_hf(folder, groups)
    module = wrap_trainable(model, Config(actor=acfg))
    actor = ActorWorker(ModelEngine(module, groups), build_optimizer(module, acfg.optim, groups, 10), acfg,
                        spec.vocab_size, TEMPERATURE, R)
    steps, mean_of = [], update.mean_of
    update.mean_of = lambda history: (steps.extend(dict(h) for h in history), mean_of(history))[1]
    metrics = actor.update_policy(dict(batch), MINI, MicroBatching(2))
    actor_steps = list(steps)
    steps.clear()
    weights = {k: v.detach().clone() for k, v in mcore_to_hf_stream(module, spec, groups)}

    ccfg = Config(critic=CriticConfig(optim=OptimConfig(lr=CRITIC_LR, eps=EPS, clip_grad=CLIP_GRAD, weight_decay=0.0),
                                      ppo_epochs=EPOCHS, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=2,
                                      cliprange_value=VALUE_CLIP)).critic
    cmodel, cspec, _ = critic_from_hf(rm_folder, groups)
    cmodule = wrap_trainable(cmodel, Config(critic=ccfg))
    critic = CriticWorker(ModelEngine(cmodule, groups), build_optimizer(cmodule, ccfg.optim, groups, 10), ccfg, R)
    critic_metrics = critic.update_critic(dict(batch), MINI, MicroBatching(2))
    critic_steps = list(steps)
    critic_weights = {k: v.detach().clone() for k, v in mcore_to_hf_stream(cmodule, cspec, groups, head="none")}
    head = cmodel.output_layer.value_head
    critic_weights.update({"score.weight": head.weight.detach().clone(), "score.bias": head.bias.detach().clone()})
    return dict(steps=[dict(s) for s in actor_steps], metrics=metrics, weights=weights, critic_steps=critic_steps,
                critic_metrics=critic_metrics, critic_weights=critic_weights)


@pytest.fixture(scope="module")
def runs(hf_folder, rm_folder):
    batch = _batch(hf_folder, rm_folder)
    ours = run_distributed(_hybridrl, 1, hf_folder, rm_folder, batch)[0]
    return ours, _reference(hf_folder, batch), _hf_model(hf_folder).state_dict(), _critic_reference(rm_folder, batch)


def test_each_of_four_optimizer_steps_matches_a_plain_torch_ppo_loop(runs):
    ours, (ref_steps, _), _, _ = runs
    assert len(ours["steps"]) == len(ref_steps) == EPOCHS * B // MINI
    assert ref_steps[0]["pg_clipfrac"] == 0 and abs(ref_steps[0]["ppo_kl"]) < 1e-6  # on-policy first step
    assert all(s["pg_clipfrac"] > 0 for s in ref_steps[2:])  # the clip engages on the second pass
    for i, (got, want) in enumerate(zip(ours["steps"], ref_steps)):
        for key in STATS:  # megatron's and transformers' fp32 forwards differ by rounding only
            value = got[f"actor/{key}"]
            assert abs(value - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (i, key, value, want[key])
        assert got["actor/lr"] == LR


def test_reported_metrics_are_the_mean_over_the_steps(runs):
    ours, (ref_steps, _), _, _ = runs
    for key in STATS:
        mean = sum(s[key] for s in ref_steps) / len(ref_steps)
        assert abs(ours["metrics"][f"actor/{key}"] - mean) <= 1e-5 * max(1.0, abs(mean)), key


def test_final_weights_match_the_reference(runs):
    ours, (_, ref_weights), start, _ = runs
    moved = max((ref_weights[k] - start[k]).abs().max().item() for k in ours["weights"])
    assert moved > LR  # four Adam steps moved the weights by ~lr each, 10^4 times the tolerance below
    for name, value in ours["weights"].items():
        torch.testing.assert_close(value, ref_weights[name], atol=2e-6, rtol=0, msg=name)


def test_critic_steps_and_weights_match_the_reference(runs):
    ours, _, _, (ref_steps, ref_weights) = runs
    assert len(ours["critic_steps"]) == len(ref_steps) == EPOCHS * B // MINI
    assert ref_steps[0]["vf_clipfrac"] == 0 and ref_steps[1]["vf_clipfrac"] > 0  # the old values are the first step's
    for i, (got, want) in enumerate(zip(ours["critic_steps"], ref_steps)):
        for key in CRITIC_STATS:
            value = got[f"critic/{key}"]
            assert abs(value - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (i, key, value, want[key])
    for key in CRITIC_STATS:
        mean = sum(s[key] for s in ref_steps) / len(ref_steps)
        assert abs(ours["critic_metrics"][f"critic/{key}"] - mean) <= 1e-5 * max(1.0, abs(mean)), key
    assert set(ours["critic_weights"]) == set(ref_weights)
    for name, value in ours["critic_weights"].items():
        torch.testing.assert_close(value, ref_weights[name].reshape(value.shape), atol=2e-6, rtol=0, msg=name)
