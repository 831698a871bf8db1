"""Native rollout engine: HF-equal greedy decoding at rollout TP 1 and 2, exact log-probs, layout-free sampling.

One 2-process launch (training TP=1, so rollout TP=2 differs from the training layout) computes
everything; the tests below check its results against transformers and against a full forward.
"""
import pytest
import torch

from copy_spy import CopySpy
from dist_helper import run_distributed

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [40, 41, 42, 43], [100, 7], [3, 3, 3, 3, 3, 3]]
NEW = 10
SAMPLED = dict(n=3, temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=NEW, seed=7)


def _reference_log_probs(model, out, prompts, n, temperature, vocab):
    """Log-probs of the responses from one full (no-cache) forward of the training-layout model."""
    from hybridrl.models.logprobs import vocab_parallel_log_probs

    rows = [(prompts[r // n], out.responses[r, :int(out.response_mask[r].sum())].tolist())
            for r in range(out.responses.shape[0])]
    length = max(len(p) + len(s) for p, s in rows)
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    valid = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, (p, s) in enumerate(rows):
        tokens[i, length - len(p) - len(s):] = torch.tensor(p + s)
        valid[i, length - len(p) - len(s):] = True
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    mask = (causal[None] | ~valid[:, None, :])[:, None]
    with torch.no_grad():
        logits = model(tokens, (valid.long().cumsum(-1) - 1).clamp(min=0), mask)
    logp = vocab_parallel_log_probs(logits[:, :-1], tokens[:, 1:], None, vocab, temperature or 1.0)
    ref = torch.zeros_like(out.log_probs)
    for i, (p, s) in enumerate(rows):
        ref[i, :len(s)] = logp[i, length - 1 - len(s):]
    return ref


def _engine_run(folder):
    from safetensors.torch import load_file

    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.native import NativeEngine

    groups = init_model_parallel(1, 1)
    model, spec = model_from_hf(folder, groups)
    model.eval()
    hf = load_file(f"{folder}/model.safetensors")
    greedy, sampled = SamplingParams(temperature=0, max_new_tokens=NEW), SamplingParams(**SAMPLED)
    res = {}
    for tp in (1, 2):
        engine = NativeEngine(spec, tp, offload_weights_on_sleep=True)
        engine.load_weights(hf.items())
        res[f"greedy_tp{tp}"] = g = engine.generate(PROMPTS, greedy)
        res[f"sampled_tp{tp}"] = s = engine.generate(PROMPTS, sampled)
        for kind, out, n, temperature in (("greedy", g, 1, 0), ("sampled", s, 3, 0.8)):
            ref = _reference_log_probs(model, out, PROMPTS, n, temperature, spec.vocab_size)
            res[f"{kind}_err_tp{tp}"] = (out.log_probs - ref).abs().max()
    # engine is the TP=2 one from here on
    seeds = [SAMPLED["seed"] + i for i in range(len(PROMPTS))]
    res["split"] = [engine.generate(PROMPTS[:2], sampled, seeds[:2]),
                    engine.generate(PROMPTS[2:], sampled, seeds[2:])]
    mine = slice(0, 2) if engine.groups.tp_rank == 0 else slice(2, None)  # TP peers, different prompts
    res["own_shard"] = engine.generate(PROMPTS[mine], sampled, seeds[mine])
    res["own_shard_rows"] = (mine.start * 3, None if mine.stop is None else mine.stop * 3)
    res["empty"] = engine.generate([], sampled, [])
    engine.max_num_seqs = 4
    res["micro"] = engine.generate(PROMPTS, sampled)
    engine.max_num_seqs = 256
    res["stop_token"] = stop = int(res["greedy_tp2"].responses[0, 3])
    res["stopped"] = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=NEW, stop_token_ids=(stop,)))
    engine.eos_id = stop  # the engine's own eos, beside the stop ids: both unread with ignore_eos
    res["ignored"] = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=NEW, stop_token_ids=(stop,),
                                                             ignore_eos=True))
    res["eos_stopped"] = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=NEW))
    engine.eos_id = None
    engine.sleep()
    try:
        engine.generate(PROMPTS, greedy)
        res["asleep_error"] = None
    except RuntimeError as e:
        res["asleep_error"] = str(e)
    res["asleep_bytes"] = sum(p.untyped_storage().nbytes() for p in engine.params.values())
    engine.wake_up()
    res["after_wake"] = engine.generate(PROMPTS, greedy)
    with CopySpy() as first_sleep:
        engine.sleep()
    name, tensor = next(iter(hf.items()))
    engine.load_weights([(name, tensor)])  # a weight update wakes a sleeping engine, without its old weights
    try:
        engine.generate(PROMPTS, greedy)
        res["partial_error"] = None
    except RuntimeError as e:
        res["partial_error"] = str(e)
    with CopySpy() as reload:
        engine.load_weights(hf.items())
    res["reload_bytes"], res["weight_bytes"] = reload.nbytes, sum(p.numel() * p.element_size()
                                                                  for p in engine.params.values())
    res["after_reload"] = engine.generate(PROMPTS, greedy)
    with CopySpy() as second_sleep:
        engine.sleep()
    res["same_host_buffers"] = first_sleep.destinations() == second_sleep.destinations()
    return res


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    return random_hf_model_folder(str(tmp_path_factory.mktemp("qwen2")), "qwen2", seed=3, num_hidden_layers=3)


@pytest.fixture(scope="module")
def runs(hf_folder):
    return run_distributed(_engine_run, 2, hf_folder)


@pytest.fixture(scope="module")
def hf_greedy(hf_folder):
    """transformers generate(do_sample=False) on the same left-padded prompts."""
    import transformers

    from models_helper import hf_greedy as greedy

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    return greedy(model, PROMPTS, NEW)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers(runs, hf_greedy, tp):
    for res in runs:
        out = res[f"greedy_tp{tp}"]
        assert torch.equal(out.responses, hf_greedy), f"rollout TP={tp} greedy differs from transformers"
        assert out.response_mask.sum() == len(PROMPTS) * NEW


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_log_probs_equal_full_forward(runs, kind):
    for res in runs:
        for tp in (1, 2):
            assert res[f"{kind}_err_tp{tp}"] < 1e-5, f"{kind} TP={tp}: {res[f'{kind}_err_tp{tp}']}"


@pytest.mark.distributed
def test_sampling_is_layout_independent(runs):
    ref = runs[0]["sampled_tp1"]
    assert ref.responses.shape == (3 * len(PROMPTS), NEW)
    for res in runs:  # every rank (both rollout-TP ranks) and every layout draws the same samples
        split = torch.cat([o.responses for o in res["split"]])
        for other in (res["sampled_tp1"].responses, res["sampled_tp2"].responses, split, res["micro"].responses):
            assert torch.equal(other, ref.responses)
        lo, hi = res["own_shard_rows"]
        assert torch.equal(res["own_shard"].responses, ref.responses[lo:hi])
        torch.testing.assert_close(res["own_shard"].log_probs, ref.log_probs[lo:hi], atol=1e-5, rtol=0)
    # the samples of one prompt differ from each other (the per-sample seeds are distinct)
    assert not torch.equal(ref.responses[0], ref.responses[1])


@pytest.mark.distributed
def test_stop_token_ends_row_and_is_kept(runs):
    res = runs[0]
    stop, full, out = res["stop_token"], res["greedy_tp2"], res["stopped"]
    for r in range(len(PROMPTS)):
        row = full.responses[r].tolist()
        keep = row.index(stop) + 1 if stop in row else NEW
        assert out.responses[r, :keep].tolist() == row[:keep]
        assert out.response_mask[r].tolist() == [1.0] * keep + [0.0] * (NEW - keep)
        assert out.responses[r, keep:].eq(0).all() and out.log_probs[r, keep:].eq(0).all()
        torch.testing.assert_close(out.log_probs[r, :keep], full.log_probs[r, :keep], atol=1e-5, rtol=0)
    assert (out.response_mask.sum(-1) < NEW).any(), "the stop token must end at least one row early"


@pytest.mark.distributed
def test_ignore_eos_generates_every_token(runs):
    """verl's rollout.ignore_eos: neither the stop ids nor the engine's eos end a row; the greedy tokens are those
    of the run without any stop (which the engine's eos alone does cut short)."""
    res = runs[0]
    full, out = res["greedy_tp2"], res["ignored"]
    assert torch.equal(out.responses, full.responses) and out.response_mask.eq(1).all()
    assert (res["eos_stopped"].response_mask.sum(-1) < NEW).any()


@pytest.mark.distributed
def test_no_requests_give_empty_output(runs):
    for res in runs:
        out = res["empty"]
        assert out.responses.shape == out.response_mask.shape == out.log_probs.shape == (0, NEW)
        assert out.stats["rollout/generated_tokens"] == 0


@pytest.mark.distributed
def test_sleep_frees_weights_and_wake_restores(runs):
    res = runs[0]
    assert "asleep" in res["asleep_error"]
    assert res["asleep_bytes"] == 0
    assert torch.equal(res["after_wake"].responses, res["greedy_tp2"].responses)
    assert torch.equal(res["after_wake"].log_probs, res["greedy_tp2"].log_probs)
    assert torch.equal(res["after_reload"].responses, res["greedy_tp2"].responses)


@pytest.mark.distributed
def test_a_weight_sync_wakes_the_engine_without_copying_the_old_weights(runs):
    """load_weights on a sleeping engine: no host-to-device copy of weights it overwrites (the bytes
    copied are the streamed ones alone); generate refuses until every weight came in; later sleeps
    reuse the host buffers of the first."""
    for res in runs:
        assert "weights not loaded" in res["partial_error"]
        assert 0 < res["reload_bytes"] <= res["weight_bytes"]
        assert res["same_host_buffers"]


def test_top_k_top_p_filter_by_hand():
    from hybridrl.rollout.base import filter_top_k_top_p

    x = torch.tensor([[0.5, 0.25, 0.125, 0.075, 0.05]]).log()
    keep = lambda y: torch.isfinite(y)[0].tolist()  # noqa: E731
    assert keep(filter_top_k_top_p(x, 2, 1.0)) == [True, True, False, False, False]
    # the smallest set with mass >= p: masses before each token are 0, .5, .75, .875, .95
    assert keep(filter_top_k_top_p(x, -1, 0.7)) == [True, True, False, False, False]
    assert keep(filter_top_k_top_p(x, -1, 0.8)) == [True, True, True, False, False]
    assert keep(filter_top_k_top_p(x, -1, 0.3)) == [True, False, False, False, False]
    # top-k first, then top-p on the renormalised rest: masses before 0, .526, .789, .921
    assert keep(filter_top_k_top_p(x, 4, 0.95)) == [True, True, True, True, False]
    assert keep(filter_top_k_top_p(x, 4, 0.9)) == [True, True, True, False, False]


def test_sampling_follows_the_distribution():
    from hybridrl.rollout.base import SamplingParams, row_keys, sample_next

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4)
    sampling = SamplingParams(temperature=0.5)
    tokens, logp = sample_next(logits, sampling, row_keys(list(range(4000)), "cpu"), torch.zeros(4000, dtype=torch.long))
    expect = torch.softmax(logits[0] / 0.5, -1)
    freq = torch.bincount(tokens, minlength=4) / 4000.0
    torch.testing.assert_close(freq, expect, atol=0.03, rtol=0)
    torch.testing.assert_close(logp, expect.log()[tokens], atol=1e-6, rtol=0)


def _pcg(x: int) -> int:
    """The PCG output hash in plain Python integers (the reference for the tensor version)."""
    state = (x * 747796405 + 2891336453) % 2 ** 32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) % 2 ** 32
    return (word >> 22) ^ word


def test_gumbel_noise_is_the_documented_hash():
    import math

    from hybridrl.rollout.base import gumbel_noise, row_keys, sample_seed

    seeds = [sample_seed(7, 0), sample_seed(7, 1), sample_seed(123456789, 5)]
    keys = row_keys(seeds, "cpu")
    index = torch.tensor([0, 3, 41])
    noise = gumbel_noise(keys, index, 50)
    for b, seed in enumerate(seeds):
        key = _pcg(_pcg(seed % 2 ** 32) ^ (seed >> 32))
        assert keys[b].item() == key
        step = _pcg((key + int(index[b]) * 0x9E3779B9) % 2 ** 32)
        for v in (0, 1, 49):
            u = ((_pcg(step ^ _pcg(v + 0x9E3779B9)) >> 8) + 0.5) / 2 ** 24
            assert noise[b, v].item() == pytest.approx(-math.log(-math.log(u)), abs=1e-5)
    # a row's noise is its own: alone, in another batch order, or beside other rows
    alone = gumbel_noise(keys[1:2], index[1:2], 50)
    flipped = gumbel_noise(keys.flip(0), index.flip(0), 50)
    assert torch.equal(alone[0], noise[1]) and torch.equal(flipped, noise.flip(0))


def test_sampling_along_one_row_follows_the_distribution():
    """One request's successive tokens (token index 0..3999): the right marginal, no step-to-step memory."""
    from hybridrl.rollout.base import SamplingParams, row_keys, sample_next, sample_seed

    steps = 4000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]]).expand(steps, 4)
    keys = row_keys([sample_seed(3, 0)], "cpu").expand(steps)
    tokens, _ = sample_next(logits, SamplingParams(temperature=1.0), keys, torch.arange(steps))
    expect = torch.softmax(logits[0], -1)
    torch.testing.assert_close(torch.bincount(tokens, minlength=4) / steps, expect, atol=0.03, rtol=0)
    pairs = torch.bincount(tokens[:-1] * 4 + tokens[1:], minlength=16).reshape(4, 4) / (steps - 1)
    torch.testing.assert_close(pairs, expect[:, None] * expect[None, :], atol=0.02, rtol=0)


def _te_named_norms() -> dict:
    """A bf16 engine (the local spec: fp32 norms) given a Transformer Engine trainer's bf16 norms by their TE names."""
    import dataclasses

    from hybridrl.models import hf_convert as hc
    from hybridrl.models.gpt import GPTSpec
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.native import NativeEngine
    from megatron_roles import SPEC

    init_model_parallel(1, 1)
    spec = GPTSpec(**SPEC)
    engine = NativeEngine(spec, 1, dtype="bfloat16")
    te = dataclasses.replace(spec, layer_spec="te")
    local_names = {hc.hf_sources(g, spec): g for g in engine.params}
    te_norms = {g: local_names[hc.hf_sources(g, te)] for _, g in hc.stage_names(te, 1, 0) if "norm" in g}
    shards = [(g, torch.full(engine.params[own].shape, 1.5, dtype=torch.bfloat16)) for g, own in te_norms.items()]
    before = {g: str(engine.stored_dtype(g)) for g in te_norms}
    held = engine.share_shards(shards)
    return {"names": sorted(te_norms), "own": sorted(te_norms.values()), "before": before,
            "after": {g: str(engine.stored_dtype(g)) for g in te_norms},
            "adopted": all(held[g][1] is engine.params[own] and held[g][1].untyped_storage() is t.untyped_storage()
                           for (g, t), own in zip(shards, te_norms.values()))}


def test_a_te_trainers_norms_are_read_by_their_te_names_in_bf16():
    """The names a Transformer Engine trainer gives its norms (fused into linear_qkv / linear_fc1 as
    `layer_norm_weight`) reach the engine's fp32 norms: shared as the bf16 tensors they are (the engine refused a
    dtype other than its own), while the dtype it stores its own copy in stays fp32."""
    out = run_distributed(_te_named_norms, 1, timeout=120)[0]
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in out["names"]), out["names"]
    assert all(n.endswith("layernorm.weight") for n in out["own"]), out["own"]
    assert set(out["before"].values()) == set(out["after"].values()) == {"torch.float32"}, out
    assert out["adopted"], out
