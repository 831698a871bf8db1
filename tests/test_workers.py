"""Actor/critic workers: log-probs match transformers; one update gives the same losses, grad norm
and new log-probs at DP=1, DP=2, TP=2 and PP=2 (global normalisation over the mini-batch)."""

import pytest
import torch

from dist_helper import run_distributed
from models_helper import padded_rl_rows

B, P, R = 8, 6, 5


def _batch(vocab):
    g = torch.Generator().manual_seed(3)
    batch = padded_rl_rows(vocab, [6, 4, 5, 6, 3, 6, 2, 5], [5, 3, 1, 5, 4, 2, 5, 3], (P, R), g)
    rmask = batch["response_mask"]
    return {**batch, "old_log_probs": -2.0 + 0.3 * torch.randn(B, R, generator=g),
            "advantages": torch.randn(B, R, generator=g) * rmask,
            "values": torch.randn(B, R, generator=g) * rmask, "returns": torch.randn(B, R, generator=g) * rmask}


def _roles_run(folder, tp, pp, agg_mode):
    from hybridrl.config import ActorConfig, Config, CriticConfig, OptimConfig
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.actor import ActorWorker
    from hybridrl.workers.critic import CriticWorker
    from hybridrl.workers.engine import ModelEngine
    from hybridrl.config.batching import MicroBatching
    from hybridrl.workers.optim import build_optimizer
    from hybridrl.trainer.step_batch import local_slice

    groups = init_model_parallel(tp, pp)
    cfg = Config(actor=ActorConfig(optim=OptimConfig(lr=1e-2), ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg_mode),
                 critic=CriticConfig(optim=OptimConfig(lr=1e-2), ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg_mode))
    model, spec = model_from_hf(folder, groups)
    module = wrap_trainable(model, cfg)
    actor = ActorWorker(ModelEngine(module, groups), build_optimizer(module, cfg.actor.optim, groups, 10),
                        cfg.actor, spec.vocab_size, temperature=0.7, max_response_length=R)
    cmodel, _, _ = critic_from_hf(folder, groups, seed=5)
    cmodule = wrap_trainable(cmodel, cfg)
    critic = CriticWorker(ModelEngine(cmodule, groups), build_optimizer(cmodule, cfg.critic.optim, groups, 10), cfg.critic,
                          max_response_length=R)
    full = _batch(spec.vocab_size)
    batch = {k: local_slice(v, groups) for k, v in full.items()}
    before, entropy = actor.compute_log_prob(batch, MicroBatching(4), with_entropy=True)
    values = critic.compute_values(batch, MicroBatching(4))
    a_metrics = actor.update_policy(batch, B // groups.dp, MicroBatching(2))
    c_metrics = critic.update_critic(batch, B // groups.dp, MicroBatching(2))
    after, _ = actor.compute_log_prob(batch, MicroBatching(4))
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


# ---- micro-batching by token budget, old log-probs from the update's own forward ---------------

FIXED, BUDGET = 2, 16  # rows per fixed micro-batch; tokens per dynamic one (rows x trimmed width)


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _saved_bytes(fn):
    """Bytes of the tensors autograd saves for backward while fn() runs (and fn's result)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


def _worker_factories(folder, groups, agg_mode):
    """Fresh actor (by entropy_coeff) and critic workers from the same checkpoint and seed."""
    import dataclasses

    from hybridrl.config import ActorConfig, Config, CriticConfig, OptimConfig
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.actor import ActorWorker
    from hybridrl.workers.critic import CriticWorker
    from hybridrl.workers.engine import ModelEngine
    from hybridrl.workers.optim import build_optimizer

    # Adam's first step is lr * g / (|g| + eps): with eps 1e-8 a gradient entry that is round-off
    # itself (~1e-8) moves by ~lr/2 either way. eps 1e-3 keeps parameters a faithful image of
    # the gradients, so fp32 round-off in them stays round-off in the parameters.
    optim = OptimConfig(lr=1e-2, eps=1e-3)
    acfg = ActorConfig(optim=optim, loss_agg_mode=agg_mode)
    ccfg = Config(critic=CriticConfig(optim=optim, loss_agg_mode=agg_mode)).critic
    cfg = Config(actor=acfg, critic=ccfg)

    def actor(coeff=0.0):
        model, spec = model_from_hf(folder, groups)
        module = wrap_trainable(model, cfg)
        worker_cfg = dataclasses.replace(acfg, entropy_coeff=coeff)
        return ActorWorker(ModelEngine(module, groups), build_optimizer(module, acfg.optim, groups, 10), worker_cfg,
                           spec.vocab_size, temperature=0.7, max_response_length=R)

    def critic():
        model, _, _ = critic_from_hf(folder, groups, seed=5)
        module = wrap_trainable(model, cfg)
        return CriticWorker(ModelEngine(module, groups), build_optimizer(module, ccfg.optim, groups, 10), ccfg,
                            max_response_length=R)

    return actor, critic


def _split_run(folder, tp, pp, agg_mode):
    """Same layout, same start: fixed vs token-budget micro-batches (actor and critic), and the
    two-pass actor step vs the one whose forward gives the old log-probs."""
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.step_batch import local_slice
    from hybridrl.config.batching import MicroBatching

    groups = init_model_parallel(tp, pp)
    actor, critic = _worker_factories(folder, groups, agg_mode)
    fixed, dynamic = MicroBatching(FIXED), MicroBatching(FIXED, BUDGET)

    full = _batch(97)
    batch = {k: local_slice(v, groups) for k, v in full.items() if k != "old_log_probs"}
    rows = B // groups.dp
    out = {"dp_rank": groups.dp_rank}
    for name, batching in (("fixed", fixed), ("dynamic", dynamic)):
        a = actor()
        out.setdefault("start", _params(a.engine.module))
        old, ent = a.compute_log_prob(batch, batching, with_entropy=True)
        metrics = a.update_policy(dict(batch, old_log_probs=old), rows, batching)
        out[name] = dict(params=_params(a.engine.module), old=old, entropy=ent, metrics=metrics)
        c = critic()
        out[name]["values"] = c.compute_values(batch, batching)
        out[name]["critic"] = c.update_critic(dict(batch, values=out[name]["values"]), rows, batching)
        out[name]["critic_params"] = _params(c.engine.module)
    one = actor()
    own = dict(batch)  # no "old_log_probs": the update's forward fills them in
    metrics = one.update_policy(own, rows, dynamic)
    out["one_step"] = dict(params=_params(one.engine.module), old=own["old_log_probs"], entropy=own["old_entropy"],
                           metrics=metrics)
    try:
        one.update_policy(dict(batch), rows // 2, dynamic)
    except ValueError as e:
        out["refused"] = str(e)
    if tp == pp == 1:  # entropy without autograd when entropy_coeff is 0
        for coeff in (0.0, 1e-3):
            a = actor(coeff)
            old, _ = a.compute_log_prob(batch, fixed)
            saved, m = _saved_bytes(lambda: a.update_policy(dict(batch, old_log_probs=old), rows, fixed))
            out[f"saved_{coeff}"], out[f"entropy_{coeff}"] = saved, m["actor/entropy_loss"]
    return out


@pytest.fixture(scope="module")
def split_single(hf_folder):
    return run_distributed(_split_run, 1, hf_folder, 1, 1, "token-mean")[0]


def _close(a, b, key):
    assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (key, a, b)


def _check_splits(out):
    rows = out["fixed"]["old"].shape[0]
    mask = _batch(97)["response_mask"].bool()[out["dp_rank"] * rows:(out["dp_rank"] + 1) * rows]
    fixed, dynamic, one = out["fixed"], out["dynamic"], out["one_step"]
    for key in ("old", "entropy", "values"):
        torch.testing.assert_close(dynamic[key][mask], fixed[key][mask], atol=1e-5, rtol=1e-5, msg=key)
    assert _max_diff(dynamic["params"], fixed["params"]) < 1e-6
    assert _max_diff(dynamic["critic_params"], fixed["critic_params"]) < 1e-6
    assert _max_diff(fixed["params"], out["start"]) > 1e-3  # the step did move the weights
    for key, value in fixed["metrics"].items():
        _close(dynamic["metrics"][key], value, key)
    for key, value in fixed["critic"].items():
        _close(dynamic["critic"][key], value, key)
    # the update's own forward gives the old log-probs of the two-pass path, and the same step
    torch.testing.assert_close(one["old"][mask], dynamic["old"][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one["entropy"][mask], dynamic["entropy"][mask], atol=1e-5, rtol=1e-5)
    assert _max_diff(one["params"], dynamic["params"]) < 1e-6
    assert set(one["metrics"]) == set(dynamic["metrics"])
    for key, value in dynamic["metrics"].items():
        _close(one["metrics"][key], value, key)
    assert one["metrics"]["actor/ppo_kl"] == 0.0 and one["metrics"]["actor/pg_clipfrac"] == 0.0
    assert "one optimizer step" in out["refused"]  # two mini-batches need the separate pass


def test_token_budget_and_own_old_log_probs_match_fixed_two_pass(split_single):
    _check_splits(split_single)


def test_entropy_gradient_keeps_no_vocab_wide_state(split_single):
    # the fused log-prob / entropy function saves per-token statistics only: an entropy term in the
    # loss (entropy_coeff > 0) adds a few [b, r] tensors to what backward keeps, not the [b, r, V]
    # fp32 softmax and shifted logits (2 * 4 * 128 bytes per position) it kept before
    positions = _trimmed_response_tokens()
    extra = split_single["saved_0.001"] - split_single["saved_0.0"]
    assert 0 <= extra <= 4 * 4 * positions, extra
    _close(split_single["entropy_0.0"], split_single["entropy_0.001"], "actor/entropy")


def _trimmed_response_tokens():
    """Positions of the response columns the fixed micro-batches of FIXED rows compute."""
    rmask = _batch(97)["response_mask"]
    return sum(FIXED * int(rmask[i:i + FIXED].sum(0).gt(0).sum()) for i in range(0, B, FIXED))


@pytest.mark.distributed
@pytest.mark.parametrize("tp,pp,agg_mode", [(2, 1, "seq-mean-token-mean"), (1, 2, "token-mean"),
                                            (1, 1, "token-mean"), (1, 1, "seq-mean-token-sum")])
def test_token_budget_matches_fixed_at_tp_pp_dp(hf_folder, tp, pp, agg_mode):
    """Each DP rank of (1, 1) makes its own number of micro-batches; the normaliser stays global."""
    outs = run_distributed(_split_run, 2, hf_folder, tp, pp, agg_mode)
    for out in outs:
        _check_splits(out)


_SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def _loss_syncs_run(folder):
    """Device-to-host reads inside the actor's and critic's per-micro-batch losses, and the metrics."""
    from torch.overrides import TorchFunctionMode

    from hybridrl.config.batching import MicroBatching
    from hybridrl.parallel.distributed import init_model_parallel

    class Reads(TorchFunctionMode):
        def __init__(self, counts):
            super().__init__()
            self.counts = counts

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in _SYNCS:
                self.counts.append(name)
            return func(*args, **(kwargs or {}))

    groups = init_model_parallel(1, 1)
    actor, critic = _worker_factories(folder, groups, "token-mean")
    a, c, batch, out = actor(), critic(), _batch(97), {}
    for name, worker, update in (("actor", a, a.update_policy), ("critic", c, c.update_critic)):
        counts, calls, loss = [], [], worker._loss

        def counted(*args, loss=loss, counts=counts, calls=calls):
            calls.append(1)
            with Reads(counts):
                return loss(*args)

        worker._loss = counted
        metrics = update(batch, B, MicroBatching(2))
        out[name] = dict(reads=counts, micro_batches=len(calls), metrics=metrics)
    return out


@pytest.mark.distributed
def test_losses_read_nothing_back_per_micro_batch(hf_folder):
    """The per-micro-batch losses leave their metrics on the device (about eight `.item()` each
    before); update.finish_step reads them once per step."""
    out = run_distributed(_loss_syncs_run, 1, hf_folder)[0]
    for role, key in (("actor", "actor/pg_loss"), ("critic", "critic/vf_loss")):
        assert out[role]["micro_batches"] == B // 2
        assert out[role]["reads"] == [], (role, out[role]["reads"])
        assert isinstance(out[role]["metrics"][key], float)
