"""HF `config.json` (Qwen2 / Llama families) -> `GPTSpec`, and back.

Only configurations the megatron local spec reproduces exactly are accepted; anything else
(sliding-window attention, unsupported rope scaling, biases megatron would place elsewhere, another
activation or model type) raises `UnsupportedConfigError` naming the field and its value, so a
checkpoint is never converted into a silently different model. No weights are touched here.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict

from hybridrl.models.gpt import GPTSpec

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
# megatron's llama-3 rope scaling hard-codes these; other values would change the frequencies.
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedConfigError(ValueError):
    """An HF config field whose value the megatron model cannot reproduce."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"cannot map HF config field {field}={value!r} to megatron: {why}")
        self.field, self.value = field, value


def load_hf_config(folder_or_file: str) -> dict:
    """The raw config.json of an HF model folder (or the file itself) as a dict."""
    path = folder_or_file
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def as_config_dict(config) -> dict:
    """A dict from a config.json dict, a folder/file path, or a transformers PretrainedConfig."""
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return load_hf_config(os.fspath(config))
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected an HF config dict, path or PretrainedConfig, got {type(config).__name__}")


def _rope(cfg: dict) -> tuple[float, float]:
    """(rope_theta, llama3 scaling factor or 0) from transformers>=5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    params = dict(params or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0, 1):
        raise UnsupportedConfigError("partial_rotary_factor", partial, "only full rotary embeddings are supported")
    if rope_type in (None, "default"):
        return theta, 0.0
    if rope_type == "llama3":
        for key, fixed in LLAMA3_ROPE_FIXED.items():
            if float(params.get(key, fixed)) != fixed:
                raise UnsupportedConfigError(f"rope_scaling.{key}", params.get(key),
                                             f"megatron's llama3 rope scaling fixes it to {fixed}")
        return theta, float(params.get("factor", 8.0))
    raise UnsupportedConfigError("rope_scaling.rope_type", rope_type, "supported: default, llama3")


def _check_attention(cfg: dict, model_type: str) -> bool:
    """Validate attention/MLP options; returns whether q/k/v carry a bias."""
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise UnsupportedConfigError("use_sliding_window", True,
                                     f"sliding-window attention (sliding_window={cfg['sliding_window']}) "
                                     "is not implemented; set use_sliding_window=false")
    for kind in cfg.get("layer_types") or []:
        if kind != "full_attention":
            raise UnsupportedConfigError("layer_types", kind, "only full_attention layers are supported")
    if model_type == "qwen2":
        return True  # Qwen2 always has q/k/v biases and no o_proj bias
    if cfg.get("attention_bias"):
        raise UnsupportedConfigError("attention_bias", True, "Llama then also biases o_proj, which megatron's "
                                     "local spec only offers together with biases on every MLP linear")
    if cfg.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias", True, "MLP biases are not supported")
    return False


def spec_from_hf_config(config) -> GPTSpec:
    """GPTSpec for a Qwen2/Llama config (dict, path or PretrainedConfig); raises on what it cannot map."""
    cfg = as_config_dict(config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfigError("hidden_act", act, "the megatron model uses SwiGLU (silu)")
    qkv_bias = _check_attention(cfg, model_type)
    theta, scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return GPTSpec(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048), rope_theta=theta,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), qkv_bias=qkv_bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=0 if head_dim * heads == cfg["hidden_size"] else head_dim,
        rope_scaling_factor=scaling)


def check_parallel_layout(spec: GPTSpec, tp: int, pp: int) -> None:
    """Fail early, with the fix, on a TP/PP layout megatron would reject deep inside its init."""
    if spec.num_key_value_heads % tp:
        raise ValueError(f"num_key_value_heads={spec.num_key_value_heads} is not divisible by tp={tp}: "
                         "megatron splits whole query groups over TP; choose tp dividing it")
    if spec.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={spec.num_attention_heads} is not divisible by tp={tp}")
    if spec.intermediate_size % tp:
        raise ValueError(f"intermediate_size={spec.intermediate_size} is not divisible by tp={tp}")
    if spec.num_layers % pp:
        raise ValueError(f"num_hidden_layers={spec.num_layers} is not divisible by pp={pp}")


def hf_config_from_spec(spec: GPTSpec, model_type: str = "qwen2", dtype: str = "float32") -> dict:
    """A config.json dict that transformers builds the same architecture from (for export)."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling_factor:
        rope = dict(rope, rope_type="llama3", factor=spec.rope_scaling_factor, **LLAMA3_ROPE_FIXED)
    cfg = dict(
        model_type=model_type, architectures=[ARCHITECTURES[model_type]], hidden_act="silu",
        num_hidden_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings, head_dim=spec.kv_channels,
        rope_parameters=rope, rope_theta=spec.rope_theta, dtype=dtype)
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif not spec.qkv_bias:
        raise UnsupportedConfigError("qkv_bias", False, "Qwen2 always has q/k/v biases; export as llama")
    return cfg


def spec_to_dict(spec: GPTSpec) -> dict:
    return asdict(spec)


def spec_from_dict(d: dict) -> GPTSpec:
    return GPTSpec(**d)
