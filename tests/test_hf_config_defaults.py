"""What a config.json leaves out means what transformers makes of it, and what megatron cannot reproduce is refused.

A trimmed config.json (no rope_theta, rms_norm_eps, num_key_value_heads, head_dim) builds, in transformers, the
family's class defaults (Mixtral rope_theta 1e6 / eps 1e-5 / 8 KV heads, Qwen3 head_dim 128 / 32 KV heads); the
megatron model must be that model: logits equal transformers' on the same folder. Top-1 routing with renormalised
weights, and megatron checkpoint folders under expert parallelism, are refused with the reason.
"""
import json
import os
import re

import pytest
import torch

from dist_helper import run_distributed
from models_helper import hf_logits, mcore_logits, ragged_batch, reinit_parallel

from hybridrl.models.hf_config import UnsupportedConfigError, spec_from_hf_config

ATOL = 1e-4
# name -> (random_hf_model_folder kwargs: the class defaults written out, fields then deleted from config.json)
TRIMMED = {
    "mixtral_rope_eps": (dict(model_type="mixtral"), ("rope_parameters", "rope_theta", "rms_norm_eps")),
    "mixtral": (dict(model_type="mixtral", num_attention_heads=16, num_key_value_heads=8),
                ("rope_parameters", "rope_theta", "rms_norm_eps", "num_key_value_heads")),
    "qwen3": (dict(model_type="qwen3", num_attention_heads=32, num_key_value_heads=32, head_dim=128),
              ("head_dim", "num_key_value_heads", "rope_parameters", "rms_norm_eps")),
}


def _trim(folder: str, fields) -> str:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key in fields:
        cfg.pop(key, None)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return folder


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    root = str(tmp_path_factory.mktemp("trimmed"))
    return {name: _trim(random_hf_model_folder(os.path.join(root, name), seed=i, **kw), fields)
            for i, (name, (kw, fields)) in enumerate(TRIMMED.items())}


MINIMAL = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96, vocab_size=300)
MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama", "qwen3_moe", "mixtral"])
def test_missing_fields_take_transformers_class_defaults(model_type):
    import transformers

    cfg = dict(model_type=model_type, **MINIMAL, **MOE.get(model_type, {}))
    spec = spec_from_hf_config(cfg)
    ref = transformers.AutoConfig.for_model(**cfg)  # what from_pretrained builds from this config.json
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    assert (spec.rope_theta, spec.rms_norm_eps, spec.num_key_value_heads, spec.kv_channels,
            spec.max_position_embeddings, spec.tie_word_embeddings) == \
        (ref.rope_parameters["rope_theta"], ref.rms_norm_eps, ref.num_key_value_heads, head_dim,
         ref.max_position_embeddings, ref.tie_word_embeddings)


def test_the_callers_config_is_not_changed():
    cfg = dict(model_type="llama", **MINIMAL, rope_theta=5e5, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))
    before = json.dumps(cfg, sort_keys=True)
    assert spec_from_hf_config(cfg).rope_scaling_factor == 8.0
    assert json.dumps(cfg, sort_keys=True) == before


def test_a_config_transformers_rejects_is_refused():
    bad = dict(model_type="llama", **MINIMAL, rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0))
    with pytest.raises(UnsupportedConfigError, match="transformers' LlamaConfig cannot read it.*high_freq_factor"):
        spec_from_hf_config(bad)


def _trimmed_logits(folders):
    from hybridrl.models.hf_checkpoint import model_from_hf

    groups = reinit_parallel(1, 1)
    out = {}
    for name, folder in folders.items():
        model, spec = model_from_hf(folder, groups)
        model.eval()
        out[name] = mcore_logits(model, spec, groups, ragged_batch(spec.vocab_size))
    return out


@pytest.mark.distributed
def test_trimmed_config_logits_equal_transformers(trimmed):
    (got,) = run_distributed(_trimmed_logits, 1, trimmed)
    for name, folder in trimmed.items():
        batch = ragged_batch(251)
        ref, valid = hf_logits(folder, batch), batch["attention_mask"].bool()
        diff = (got[name][valid] - ref[valid]).abs().max().item()
        assert diff < ATOL, f"{name} without {TRIMMED[name][1]}: max |megatron - transformers| = {diff:.2e}"


# ---- top-1 routing ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, extra, field", [
    ("mixtral", {}, "num_experts_per_tok"),
    ("qwen3_moe", dict(norm_topk_prob=True), "norm_topk_prob"),
])
def test_top1_with_renormalised_weight_is_refused(model_type, extra, field):
    cfg = {"model_type": model_type, **MINIMAL, **MOE[model_type], **extra, "num_experts_per_tok": 1}
    with pytest.raises(UnsupportedConfigError, match=re.escape(field)) as e:
        spec_from_hf_config(cfg)
    assert e.value.field == field and "num_experts_per_tok=1" in str(e.value) and "1.0" in str(e.value)


def test_top1_without_renormalisation_is_kept():
    spec = spec_from_hf_config({"model_type": "qwen3_moe", **MINIMAL, **MOE["qwen3_moe"], "num_experts_per_tok": 1,
                                "norm_topk_prob": False})
    assert (spec.moe_topk, spec.norm_topk_prob) == (1, False)


# ---- megatron checkpoint folders and expert parallelism -----------------------------------------------------

def _ep2_groups(ep_rank: int):
    from hybridrl.parallel.distributed import ParallelGroups

    return ParallelGroups(tp=1, pp=1, dp=2, tp_rank=0, pp_rank=0, dp_rank=ep_rank, tp_group=None, pp_group=None,
                          dp_group=None, mp_group=None, ep=2, ep_rank=ep_rank)


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_mcore_checkpoint_refuses_expert_parallelism(tmp_path, ep_rank):
    from hybridrl.models.mcore_checkpoint import load_mcore_checkpoint, save_mcore_checkpoint

    spec = spec_from_hf_config(dict(model_type="qwen3_moe", **MINIMAL, **MOE["qwen3_moe"]))
    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        save_mcore_checkpoint(object(), str(tmp_path / "out"), spec, _ep2_groups(ep_rank), {})
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        load_mcore_checkpoint(object(), str(tmp_path / "out"), _ep2_groups(ep_rank))


# ---- exports carry the source folder's tokenizer and generation config ------------------------------------

def test_offline_export_carries_tokenizer_and_generation_config(tmp_path):
    import transformers

    from hybridrl.models.hf_checkpoint import random_hf_model_folder
    from hybridrl.models.mcore_checkpoint import hf_folder_to_mcore, mcore_folder_to_hf
    from hybridrl.tokenizer import save_tiny_tokenizer

    src = random_hf_model_folder(str(tmp_path / "src"), "qwen2")
    save_tiny_tokenizer(src)
    (tmp_path / "src" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, eos_token_id=2).save_pretrained(src)
    present = sorted(set(os.listdir(src)) - {"config.json", "model.safetensors"})
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(present)

    hf_folder_to_mcore(src, str(tmp_path / "mcore"), tp=1, pp=1)
    mcore_folder_to_hf(str(tmp_path / "mcore"), str(tmp_path / "out"))
    for name in present:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "src" / name).read_bytes(), name
    src_tok, out_tok = (transformers.AutoTokenizer.from_pretrained(f) for f in (src, str(tmp_path / "out")))
    assert out_tok("1+2=3")["input_ids"] == src_tok("1+2=3")["input_ids"]
    assert out_tok.chat_template == src_tok.chat_template
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path / "out")).to_dict() == \
        transformers.GenerationConfig.from_pretrained(src).to_dict()
