"""HF config -> GPTSpec mapping, and the errors for what the converter cannot map or load (no processes)."""
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.models.gpt import GPTSpec
from hybridrl.models.hf_checkpoint import CheckpointMismatchError, random_hf_model_folder
from hybridrl.models.hf_config import (UnsupportedConfigError, check_parallel_layout, hf_config_from_spec,
                                       load_hf_config, spec_from_hf_config)
from hybridrl.models.mcore_checkpoint import hf_folder_to_mcore

UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return random_hf_model_folder(str(tmp_path_factory.mktemp("hf") / "qwen2"), "qwen2")


def _edited_copy(folder, tmp_path, edit):
    out = tmp_path / "edited"
    out.mkdir()
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    return str(out)


def test_missing_tensor_names_it_and_its_shape(folder, tmp_path):
    bad = _edited_copy(folder, tmp_path, lambda t: t.pop(UP))
    with pytest.raises(CheckpointMismatchError, match=rf"missing tensor '{UP}' \(expected shape \[96, 64\]\)"):
        hf_folder_to_mcore(bad, str(tmp_path / "out"), tp=2, pp=1)


def test_unknown_tensor_is_named(folder, tmp_path):
    bad = _edited_copy(folder, tmp_path, lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected tensor 'model\.layers\.7\.mlp\.up_proj\.weight'"):
        hf_folder_to_mcore(bad, str(tmp_path / "out"), tp=1, pp=1)


def test_shape_mismatch_names_tensor_and_expected_shape(folder, tmp_path):
    bad = _edited_copy(folder, tmp_path, lambda t: t.update({UP: torch.zeros(95, 64)}))
    with pytest.raises(CheckpointMismatchError,
                       match=rf"tensor '{UP}' has shape \[95, 64\], expected shape \[96, 64\]"):
        hf_folder_to_mcore(bad, str(tmp_path / "out"), tp=1, pp=2)


def test_untied_lm_head_required_but_tolerated_when_tied(folder, tmp_path):
    cfg = load_hf_config(folder)
    assert not cfg["tie_word_embeddings"]
    bad = _edited_copy(folder, tmp_path, lambda t: t.pop("lm_head.weight"))
    expected = r"missing tensor 'lm_head\.weight' \(expected shape \[251, 64\]\)"
    with pytest.raises(CheckpointMismatchError, match=expected):
        hf_folder_to_mcore(bad, str(tmp_path / "out"), tp=1, pp=1)


BASE = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, num_hidden_layers=2, vocab_size=251, hidden_act="silu")


@pytest.mark.parametrize("edit, field, value", [
    (dict(model_type="gpt2"), "model_type", "gpt2"),
    (dict(hidden_act="gelu"), "hidden_act", "gelu"),
    (dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window", True),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0)), "rope_scaling.rope_type", "yarn"),
    (dict(rope_theta=1e4, rope_scaling=dict(type="linear", factor=2.0)), "rope_scaling.rope_type", "linear"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)), "rope_scaling.low_freq_factor", 2.0),
    (dict(model_type="llama", attention_bias=True), "attention_bias", True),
    (dict(model_type="llama", mlp_bias=True), "mlp_bias", True),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor", 0.5),
])
def test_unmappable_config_names_field_and_value(edit, field, value):
    with pytest.raises(UnsupportedConfigError, match=re.escape(f"{field}={value!r}")) as e:
        spec_from_hf_config({**BASE, **edit})
    assert e.value.field == field and e.value.value == value


def test_config_mapping_fields():
    qwen = spec_from_hf_config({**BASE, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    assert (qwen.qkv_bias, qwen.rope_theta, qwen.rms_norm_eps, qwen.tie_word_embeddings) == (True, 1e6, 1e-5, True)
    llama = spec_from_hf_config({**BASE, "model_type": "llama", "head_dim": 32, "num_key_value_heads": None,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert (llama.qkv_bias, llama.kv_channels, llama.num_key_value_heads, llama.rope_theta) == (False, 32, 4, 5e5)
    assert spec_from_hf_config({**BASE, "use_sliding_window": False, "sliding_window": 4096}).num_layers == 2


def test_spec_to_hf_config_round_trip():
    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   vocab_size=251, rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=True, head_dim=32,
                   rope_scaling_factor=8.0, max_position_embeddings=64)
    assert spec_from_hf_config(hf_config_from_spec(spec, "llama")) == spec


def test_parallel_layout_errors_say_what_to_change():
    spec = spec_from_hf_config({**BASE, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by tp=2"):
        check_parallel_layout(spec, 2, 1)
    with pytest.raises(ValueError, match="num_hidden_layers=2 is not divisible by pp=4"):
        check_parallel_layout(spec, 1, 4)
