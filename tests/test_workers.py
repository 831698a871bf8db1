"""Actor/critic workers: log-probs match transformers; one update gives the same losses, grad norm
and new log-probs at DP=1, DP=2, TP=2 and PP=2 (global normalisation over the mini-batch)."""
import os

import pytest
import torch

from dist_helper import run_distributed

B, P, R = 8, 6, 5


def _batch(vocab):
    g = torch.Generator().manual_seed(3)
    prompt_len = torch.tensor([6, 4, 5, 6, 3, 6, 2, 5])
    resp_len = torch.tensor([5, 3, 1, 5, 4, 2, 5, 3])
    pmask = (torch.arange(P)[None] >= (P - prompt_len)[:, None]).float()
    rmask = (torch.arange(R)[None] < resp_len[:, None]).float()
    prompts = torch.randint(1, vocab, (B, P), generator=g) * pmask.long()
    responses = torch.randint(1, vocab, (B, R), generator=g) * rmask.long()
    return {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([pmask, rmask], 1),
            "responses": responses, "response_mask": rmask,
            "old_log_probs": -2.0 + 0.3 * torch.randn(B, R, generator=g),
            "advantages": torch.randn(B, R, generator=g) * rmask,
            "values": torch.randn(B, R, generator=g) * rmask, "returns": torch.randn(B, R, generator=g) * rmask}


def _roles_run(folder, tp, pp, agg_mode):
    from hybridrl.config import ActorConfig, Config, CriticConfig, OptimConfig
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.roles import _trainable
    from hybridrl.workers.actor import ActorWorker
    from hybridrl.workers.critic import CriticWorker
    from hybridrl.workers.engine import ModelEngine
    from hybridrl.workers.optim import build_optimizer
    from hybridrl.step_batch import local_slice

    groups = init_model_parallel(tp, pp)
    cfg = Config(actor=ActorConfig(optim=OptimConfig(lr=1e-2), ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg_mode),
                 critic=CriticConfig(optim=OptimConfig(lr=1e-2), ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg_mode))
    model, spec = model_from_hf(folder, groups)
    module = _trainable(model, cfg)
    actor = ActorWorker(ModelEngine(module, groups), build_optimizer(module, cfg.actor.optim, groups, 10),
                        cfg.actor, spec.vocab_size, temperature=0.7, max_response_length=R)
    cmodel, _, _ = critic_from_hf(folder, groups, seed=5)
    cmodule = _trainable(cmodel, cfg)
    critic = CriticWorker(ModelEngine(cmodule, groups), build_optimizer(cmodule, cfg.critic.optim, groups, 10), cfg.critic,
                          max_response_length=R)
    full = _batch(spec.vocab_size)
    batch = {k: local_slice(v, groups) for k, v in full.items()}
    before, entropy = actor.compute_log_prob(batch, 4, with_entropy=True)
    values = critic.compute_values(batch, 4)
    a_metrics = actor.update_policy(batch, mini_batch_rows=B // groups.dp)
    c_metrics = critic.update_critic(batch, mini_batch_rows=B // groups.dp)
    after, _ = actor.compute_log_prob(batch, 4)
    return dict(before=before, entropy=entropy, values=values, after=after, actor=a_metrics, critic=c_metrics,
                dp_rank=groups.dp_rank)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = str(tmp_path_factory.mktemp("hf") / "qwen2")
    return random_hf_model_folder(folder, "qwen2", seed=0, num_hidden_layers=2, vocab_size=97)


def _hf_log_probs(folder, temperature):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = _batch(model.config.vocab_size)
    mask = batch["attention_mask"]
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask.long(), position_ids=pos).logits
    logits = logits[:, P - 1:-1] / temperature
    return torch.log_softmax(logits.double(), -1).gather(-1, batch["responses"][..., None]).squeeze(-1).float(), batch


@pytest.fixture(scope="module")
def reference(hf_folder):
    return run_distributed(_roles_run, 1, hf_folder, 1, 1, "token-mean")[0]


def test_log_probs_match_transformers(hf_folder, reference):
    expect, batch = _hf_log_probs(hf_folder, 0.7)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(reference["before"][mask], expect[mask], atol=1e-4, rtol=0)
    assert reference["actor"]["actor/grad_norm"] > 0 and reference["critic"]["critic/grad_norm"] > 0
    assert not torch.allclose(reference["after"][mask], reference["before"][mask])


def _merge(outs):
    seen, parts = set(), []
    for o in sorted(outs, key=lambda o: o["dp_rank"]):
        if o["dp_rank"] not in seen:
            seen.add(o["dp_rank"])
            parts.append(o)
    return {k: torch.cat([p[k] for p in parts]) for k in ("before", "after", "values")}, parts[0]


@pytest.mark.distributed
@pytest.mark.parametrize("tp,pp,world", [(1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_layouts_match_single_process(hf_folder, reference, tp, pp, world):
    outs = run_distributed(_roles_run, world, hf_folder, tp, pp, "token-mean")
    merged, first = _merge(outs)
    mask = _batch(97)["response_mask"].bool()
    for key in ("before", "after", "values"):
        torch.testing.assert_close(merged[key][mask], reference[key][mask], atol=1e-5, rtol=1e-4, msg=key)
    for role in ("actor", "critic"):
        for key, value in reference[role].items():
            assert abs(first[role][key] - value) <= 1e-5 * max(1.0, abs(value)), (role, key, first[role][key], value)


@pytest.mark.distributed
def test_seq_mean_mode_dp2_matches(hf_folder):
    ref = run_distributed(_roles_run, 1, hf_folder, 1, 1, "seq-mean-token-mean")[0]
    outs = run_distributed(_roles_run, 2, hf_folder, 1, 1, "seq-mean-token-mean")
    for key, value in ref["actor"].items():
        assert abs(outs[0]["actor"][key] - value) <= 1e-5 * max(1.0, abs(value)), key
