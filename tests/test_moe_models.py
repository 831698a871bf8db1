"""Qwen3 (dense) and the MoE families (Qwen3-MoE, Mixtral) against transformers' own classes.

Tiny random models saved by transformers (GQA, odd vocab, head_dim != hidden/heads, 4 experts top 2):
logits within 1e-4 (fp32) at TP 1/2, PP 1/2 and EP 1/2 (MoE at TP 2: inference; megatron trains MoE at TP > 1
only with sequence parallelism, which this build does not run), the
export back to HF loads in transformers with the same logits, and what cannot be reproduced is refused.
"""
import os

import pytest
import torch

from dist_helper import run_distributed
from models_helper import hf_logits, mcore_logits, ragged_batch, reinit_parallel

from hybridrl.models import hf_convert as hc
from hybridrl.models.hf_config import UnsupportedConfigError, hf_config_from_spec, spec_from_hf_config

ATOL = 1e-4
MOE_CASES = {
    "qwen3_moe_norm": dict(model_type="qwen3_moe", norm_topk_prob=True),
    "qwen3_moe_raw": dict(model_type="qwen3_moe", norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral"),
}
CASES = {"qwen3": dict(model_type="qwen3"), **MOE_CASES}
COMMON = dict(num_hidden_layers=4, vocab_size=253, head_dim=24)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    root = str(tmp_path_factory.mktemp("moe"))
    return {name: random_hf_model_folder(os.path.join(root, name), seed=i, **COMMON, **kw)
            for i, (name, kw) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def references(folders):
    return {name: hf_logits(folder, ragged_batch(253)) for name, folder in folders.items()}


def _close(got, ref, what):
    valid = ragged_batch(253)["attention_mask"].bool()
    diff = (got[valid] - ref[valid]).abs().max().item()
    assert diff < ATOL, f"{what}: max |megatron - transformers| = {diff:.2e}"


def test_specs_of_the_new_families(folders):
    q3 = spec_from_hf_config(folders["qwen3"])
    assert q3.qk_norm and not q3.qkv_bias and not q3.is_moe and q3.kv_channels == 24
    raw = spec_from_hf_config(folders["qwen3_moe_raw"])
    assert (raw.num_experts, raw.moe_topk, raw.moe_intermediate_size, raw.norm_topk_prob) == (4, 2, 32, False)
    mix = spec_from_hf_config(folders["mixtral"])
    assert mix.is_moe and not mix.qk_norm and mix.norm_topk_prob and mix.moe_hf_names == "mixtral"
    for name, folder in folders.items():  # the exported config describes the same model
        spec = spec_from_hf_config(folder)
        assert spec_from_hf_config(hf_config_from_spec(spec)) == spec, name


@pytest.mark.parametrize("field,value,model_type", [
    ("mlp_only_layers", [1], "qwen3_moe"), ("decoder_sparse_step", 2, "qwen3_moe"),
    ("router_jitter_noise", 0.1, "mixtral"), ("sliding_window", 4096, "mixtral"),
    ("attention_bias", True, "qwen3"), ("use_sliding_window", True, "qwen3"),
])
def test_what_cannot_be_reproduced_is_refused(folders, field, value, model_type):
    from hybridrl.models.hf_config import load_hf_config

    name = {"qwen3_moe": "qwen3_moe_norm"}.get(model_type, model_type)
    cfg = dict(load_hf_config(folders[name]), **{field: value})
    if field == "use_sliding_window":
        cfg["sliding_window"] = 128
    with pytest.raises(UnsupportedConfigError, match=field):
        spec_from_hf_config(cfg)


def test_expert_names_per_family_and_ep_rank(folders):
    spec = spec_from_hf_config(folders["mixtral"])
    names = dict(hc.stage_names(spec, 2, 1, ep=2, ep_rank=1))
    local = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert names[local] == "decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight"
    assert hc.hf_sources(names[local], spec) == ("model.layers.2.block_sparse_moe.experts.2.w1.weight",
                                                 "model.layers.2.block_sparse_moe.experts.2.w3.weight")
    assert sum(".local_experts." in n for n in names) == 2 * 2 * 2  # 2 layers x 2 experts x (fc1, fc2)
    q = spec_from_hf_config(folders["qwen3_moe_norm"])
    assert hc.hf_sources("decoder.layers.1.mlp.router.weight", q) == ("model.layers.1.mlp.gate.weight",)
    assert hc.hf_sources("decoder.layers.1.self_attention.k_layernorm.weight", q) == \
        ("model.layers.1.self_attn.k_norm.weight",)
    assert hc.owner_ep_rank("decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight", q, 2) == 1


def _layouts_run(folders, layouts):
    from hybridrl.models.hf_checkpoint import model_from_hf

    out = {}
    for tp, pp, ep in layouts:
        groups = reinit_parallel(tp, pp, ep)
        for name, folder in folders.items():
            if ep > 1 and name not in MOE_CASES:
                continue
            model, spec = model_from_hf(folder, groups)
            model.eval()  # megatron refuses MoE *training* at TP > 1 without sequence parallelism, not inference
            logits = mcore_logits(model, spec, groups, ragged_batch(spec.vocab_size))
            if logits is not None:
                out.setdefault((tp, pp, ep, name), logits)
    return out


@pytest.mark.distributed
def test_logits_match_transformers_at_tp_pp_ep(folders, references):
    layouts = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
    merged = {}
    for r in run_distributed(_layouts_run, 2, folders, layouts):
        merged.update(r)
    expected = {(1, 1, 1, n) for n in CASES} | {(2, 1, 1, n) for n in CASES} | {(1, 2, 1, n) for n in CASES} | \
        {(1, 1, 2, n) for n in MOE_CASES}
    assert set(merged) == expected
    for (tp, pp, ep, name), logits in merged.items():
        _close(logits, references[name], f"{name} tp={tp} pp={pp} ep={ep}")


def _export_run(folders, out_root):
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, model_from_hf, save_hf

    groups = reinit_parallel(1, 2, 2)  # PP 2 x EP 2 on 4 ranks
    for name in MOE_CASES:
        model, spec = model_from_hf(folders[name], groups)
        logits = mcore_logits(model, spec, groups, ragged_batch(spec.vocab_size))
        save_hf(os.path.join(out_root, name), mcore_to_hf_stream(model, spec, groups), hf_config_from_spec(spec))
        if logits is not None:
            torch.save(logits, os.path.join(out_root, f"{name}.logits.{groups.ep_rank}.pt"))
    return True


@pytest.mark.distributed
def test_pp2_ep2_logits_and_export_round_trip(folders, references, tmp_path):
    from safetensors.torch import load_file

    run_distributed(_export_run, 4, folders, str(tmp_path))
    for name in MOE_CASES:
        for ep_rank in (0, 1):
            _close(torch.load(tmp_path / f"{name}.logits.{ep_rank}.pt"), references[name], f"{name} pp2 ep2")
        src, dst = load_file(os.path.join(folders[name], "model.safetensors")), \
            load_file(tmp_path / name / "model.safetensors")
        assert set(src) == set(dst), name
        for k in src:  # bit-exact round trip, every expert from its own EP rank
            assert torch.equal(src[k], dst[k]), k
        _close(hf_logits(str(tmp_path / name), ragged_batch(253)), references[name], f"{name} exported")
