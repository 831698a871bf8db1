"""Native engine on Qwen3 (q/k norms), Qwen3-MoE (norm_topk_prob true and false) and Mixtral.

Tiny random models saved by transformers (GQA, odd vocab 253, head_dim 24 != hidden/heads, 4 experts
top 2). One 2-process launch, with megatron's parallel_state at the trainer's EP 2 (the engine builds
its own EP-1 groups), generates at rollout TP 1 and 2; the tests compare with transformers: greedy
tokens against `generate`, log-probs and recorded routes against one forward over the same rows laid
out as the trainer lays them out ([prompts left-padded to P; responses]), with hooks on the routers.
"""
import os

import pytest
import torch

from dist_helper import run_distributed

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [40, 41, 42, 43], [100, 7, 250]]
NEW = 8
GREEDY = dict(temperature=0.0, max_new_tokens=NEW)
# sampled, with stop ids (rows end at different lengths) and 3 slots (refills, compaction)
SAMPLED = dict(n=2, temperature=0.8, max_new_tokens=NEW, seed=5, stop_token_ids=tuple(range(2, 253, 9)))
CASES = {"qwen3": dict(model_type="qwen3"),
         "qwen3_moe_norm": dict(model_type="qwen3_moe", norm_topk_prob=True),
         "qwen3_moe_raw": dict(model_type="qwen3_moe", norm_topk_prob=False),
         "mixtral": dict(model_type="mixtral")}
MOE = [n for n in CASES if n != "qwen3"]
COMMON = dict(num_hidden_layers=3, vocab_size=253, head_dim=24)


def _engine_run(folders):
    from safetensors.torch import load_file

    from hybridrl.models.hf_config import spec_from_hf_config
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.native import NativeEngine

    init_model_parallel(1, 1, ep=2)  # the trainer's expert layout must not leak into the engine's
    res = {}
    for name, folder in folders.items():
        spec, weights = spec_from_hf_config(folder), load_file(os.path.join(folder, "model.safetensors"))
        for tp in (1, 2):
            engine = NativeEngine(spec, tp, record_routes=spec.is_moe, max_num_seqs=3)
            engine.load_weights(weights.items())
            res[name, tp, "greedy"] = engine.generate(PROMPTS, SamplingParams(**GREEDY))
            res[name, tp, "sampled"] = engine.generate(PROMPTS, SamplingParams(**SAMPLED))
        if spec.is_moe:  # not asked: no routes; megatron's own forward runs MoE too (at TP 2 here)
            quiet = NativeEngine(spec, 2)
            quiet.load_weights(weights.items())
            res[name, "unrecorded"] = quiet.generate(PROMPTS, SamplingParams(**GREEDY))
            static = NativeEngine(spec, 2, decode="megatron")
            static.load_weights(weights.items())
            res[name, "megatron"] = static.generate(PROMPTS, SamplingParams(**GREEDY))
    return res


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    root = str(tmp_path_factory.mktemp("rollout_moe"))
    return {name: random_hf_model_folder(os.path.join(root, name), seed=10 + i, **COMMON, **kw)
            for i, (name, kw) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def runs(folders):
    return run_distributed(_engine_run, 2, folders)


def _hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_greedy(folder):
    from models_helper import hf_greedy

    return hf_greedy(_hf_model(folder), PROMPTS, NEW)


def _trainer_rows(out, n: int):
    """input_ids / attention_mask [rows, P + R] as the trainer builds them: [left-padded prompts; responses]."""
    width = max(map(len, PROMPTS))
    prompts = [PROMPTS[r // n] for r in range(out.responses.shape[0])]
    pmask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids = torch.cat([torch.tensor([[0] * (width - len(p)) + p for p in prompts]), out.responses], 1)
    return ids, torch.cat([pmask, out.response_mask.long()], 1)


def _hf_forward(folder, ids, mask):
    """(logits [B, S, V], routes [B, S, moe_layers, k] or None) of one transformers forward."""
    model = _hf_model(folder)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: chosen.append(out[2])) for m in routers]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    for h in hooks:
        h.remove()
    routes = torch.stack([c.view(*ids.shape, -1) for c in chosen], 2) if chosen else None
    return logits, routes


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_transformers_generate(runs, folders, name):
    ref = _hf_greedy(folders[name])
    for res in runs:  # both ranks, rollout TP 1 and 2
        for tp in (1, 2):
            assert torch.equal(res[name, tp, "greedy"].responses, ref), f"{name} rollout TP={tp}"
        if name in MOE:
            assert torch.equal(res[name, "megatron"].responses, ref), f"{name} decode='megatron'"


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_log_probs_and_routes_equal_transformers(runs, folders, name, kind):
    n, temperature = (SAMPLED["n"], SAMPLED["temperature"]) if kind == "sampled" else (1, 1.0)
    out = runs[0][name, 1, kind]
    ids, mask = _trainer_rows(out, n)
    logits, hf_routes = _hf_forward(folders[name], ids, mask)
    width, resp = max(map(len, PROMPTS)), out.response_mask.bool()
    logp = torch.log_softmax(logits[:, width - 1:-1] / temperature, -1).gather(-1, out.responses[..., None])[..., 0]
    if kind == "sampled":
        assert resp.sum() < resp.numel() and not torch.equal(out.responses[0], out.responses[1])  # stops, samples
    for res in runs:
        for tp in (1, 2):
            got = res[name, tp, kind]
            assert torch.equal(got.responses, out.responses), f"{name} {kind}: TP={tp} differs from TP=1"
            err = (got.log_probs - logp)[resp].abs().max()
            assert err < 1e-4, f"{name} {kind} TP={tp}: log-probs differ from transformers by {err:.2e}"
            if name not in MOE:
                assert got.routed_experts is None
                continue
            routes = got.routed_experts
            assert routes.dtype == torch.int16 and routes.shape == (*ids.shape, COMMON["num_hidden_layers"], 2)
            valid = mask.bool()
            assert torch.equal(routes[valid].long(), hf_routes[valid]), f"{name} {kind} TP={tp}: routes differ"
            assert (routes[~valid] == torch.arange(2, dtype=torch.int16)).all(), "padding holds arange(topk)"


@pytest.mark.distributed
@pytest.mark.parametrize("name", MOE)
def test_routes_only_when_asked(runs, name):
    unrecorded = runs[0][name, "unrecorded"]
    assert unrecorded.routed_experts is None
    assert torch.equal(unrecorded.responses, runs[0][name, 2, "greedy"].responses)


def test_record_routes_refusals(folders):
    from hybridrl.models.hf_config import spec_from_hf_config
    from hybridrl.rollout.native import NativeEngine

    with pytest.raises(ValueError, match="needs an MoE model"):
        NativeEngine(spec_from_hf_config(folders["qwen3"]), 1, record_routes=True)
    with pytest.raises(ValueError, match="decode='lean'"):
        NativeEngine(spec_from_hf_config(folders["mixtral"]), 1, decode="megatron", record_routes=True)
