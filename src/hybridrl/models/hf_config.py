"""HF `config.json` (Qwen2, Qwen3, Llama; Qwen3-MoE and Mixtral) -> `GPTSpec`, and back.

A config.json is read as transformers reads it: a field it leaves out takes the family's class default
(Mixtral rope_theta 1e6, Qwen3 head_dim 128, ...), never a default of our own. Only configurations the
megatron local spec reproduces exactly are accepted; anything else (sliding-window attention, unsupported
rope scaling, biases megatron would place elsewhere, top-1 routing with a renormalised weight, another
activation or model type) raises `UnsupportedConfigError` naming the field and its value, so a
checkpoint is never converted into a silently different model. No weights are touched here.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict

from hybridrl.models.gpt import GPTSpec

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "mixtral")
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
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


def with_transformers_defaults(cfg: dict) -> dict:
    """`cfg` as transformers' config class of its model_type reads it (`from_pretrained` builds the model from
    this): absent fields filled with the class defaults, derived ones (KV heads, head_dim, rope_parameters
    from rope_theta/rope_scaling) derived as transformers does."""
    import transformers

    cls = transformers.CONFIG_MAPPING[cfg["model_type"]]
    try:  # a deep copy: transformers rewrites nested dicts such as rope_scaling in place
        return cls.from_dict(copy.deepcopy(cfg)).to_dict()
    except (KeyError, ValueError, TypeError) as e:
        raise UnsupportedConfigError("model_type", cfg["model_type"],
                                     f"transformers' {cls.__name__} cannot read it either: {e}") from e


def _rope(cfg: dict) -> tuple[float, float]:
    """(rope_theta, llama3 scaling factor or 0) from transformers>=5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    params = dict(params or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise UnsupportedConfigError("rope_theta", None, "the config gives no rope_theta")
    theta = float(theta)
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
    if model_type == "mixtral" and cfg.get("sliding_window"):
        raise UnsupportedConfigError("sliding_window", cfg["sliding_window"],
                                     "sliding-window attention is not implemented; set sliding_window to null")
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
        raise UnsupportedConfigError("attention_bias", True, "it also biases o_proj, which megatron's "
                                     "local spec only offers together with biases on every MLP linear")
    if cfg.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias", True, "MLP biases are not supported")
    return False


def _moe_fields(cfg: dict, model_type: str) -> dict:
    """GPTSpec's expert fields of a Qwen3-MoE or Mixtral config (empty for a dense family)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers"):
            raise UnsupportedConfigError("mlp_only_layers", cfg["mlp_only_layers"],
                                         "dense layers between MoE layers are not supported; every layer must be MoE")
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedConfigError("decoder_sparse_step", cfg["decoder_sparse_step"],
                                         "only 1 (every layer MoE) is supported")
        experts, size = cfg.get("num_experts") or cfg.get("num_local_experts"), cfg["moe_intermediate_size"]
        norm_topk = bool(cfg.get("norm_topk_prob", False))
    else:
        if cfg.get("router_jitter_noise"):
            raise UnsupportedConfigError("router_jitter_noise", cfg["router_jitter_noise"],
                                         "router jitter is not reproduced; set it to 0.0")
        experts, size, norm_topk = cfg["num_local_experts"], cfg["intermediate_size"], True
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedConfigError("shared_expert_intermediate_size", cfg["shared_expert_intermediate_size"],
                                     "shared experts are not supported")
    topk = int(cfg["num_experts_per_tok"])
    if topk == 1 and norm_topk:  # megatron gives the expert its softmax probability p (and asks for pre-softmax)
        field, value = ("norm_topk_prob", True) if model_type == "qwen3_moe" else ("num_experts_per_tok", 1)
        raise UnsupportedConfigError(field, value, "top-1 routing (num_experts_per_tok=1) with a renormalised weight "
                                     "gives the chosen expert weight 1.0 in transformers but its router probability "
                                     "p in megatron" + ("; set norm_topk_prob=false to route top-1 with weight p"
                                                        if model_type == "qwen3_moe" else ""))
    return dict(num_experts=int(experts), moe_topk=topk,
                moe_intermediate_size=int(size), norm_topk_prob=norm_topk, moe_hf_names=model_type)


def spec_from_hf_config(config) -> GPTSpec:
    """GPTSpec for a supported config (dict, path or PretrainedConfig); raises on what it cannot map."""
    cfg = as_config_dict(config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    cfg = with_transformers_defaults(cfg)
    act = cfg["hidden_act"]
    if act != "silu":
        raise UnsupportedConfigError("hidden_act", act, "the megatron model uses SwiGLU (silu)")
    qkv_bias = _check_attention(cfg, model_type)
    theta, scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads  # as the modeling code derives it
    return GPTSpec(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=cfg["num_key_value_heads"],
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"], rope_theta=theta,
        rms_norm_eps=cfg["rms_norm_eps"], qkv_bias=qkv_bias,
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        head_dim=0 if head_dim * heads == cfg["hidden_size"] else head_dim,
        rope_scaling_factor=scaling, qk_norm=model_type in QK_NORM_MODEL_TYPES, **_moe_fields(cfg, model_type))


def check_parallel_layout(spec: GPTSpec, tp: int, pp: int, ep: int = 1) -> None:
    """Fail early, with the fix, on a TP/PP/EP layout megatron would reject deep inside its init (a dense
    model ignores EP: a dense reward model or critic may serve an MoE actor's expert-parallel layout)."""
    if spec.is_moe and spec.num_experts % ep:
        raise ValueError(f"num_experts={spec.num_experts} is not divisible by expert_model_parallel_size={ep}")
    if spec.is_moe and spec.moe_intermediate_size % tp:
        raise ValueError(f"moe_intermediate_size={spec.moe_intermediate_size} is not divisible by tp={tp} "
                         "(experts are split over TP)")
    if spec.num_key_value_heads % tp:
        raise ValueError(f"num_key_value_heads={spec.num_key_value_heads} is not divisible by tp={tp}: "
                         "megatron splits whole query groups over TP; choose tp dividing it")
    if spec.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={spec.num_attention_heads} is not divisible by tp={tp}")
    if not spec.is_moe and spec.intermediate_size % tp:
        raise ValueError(f"intermediate_size={spec.intermediate_size} is not divisible by tp={tp}")
    if spec.num_layers % pp:
        raise ValueError(f"num_hidden_layers={spec.num_layers} is not divisible by pp={pp}")


def model_type_of(spec: GPTSpec) -> str:
    """The HF family a spec exports as: the MoE naming, qwen3 (q/k norms), qwen2 (q/k/v biases) or llama."""
    if spec.is_moe:
        return spec.moe_hf_names
    return "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias else "llama"


def hf_config_from_spec(spec: GPTSpec, model_type: str | None = None, dtype: str = "float32") -> dict:
    """A config.json dict that transformers builds the same architecture from (for export);
    model_type defaults to `model_type_of(spec)`."""
    model_type = model_type or model_type_of(spec)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type in MOE_MODEL_TYPES + QK_NORM_MODEL_TYPES and model_type != model_type_of(spec):
        raise UnsupportedConfigError("model_type", model_type, f"the model is a {model_type_of(spec)}")
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
    if model_type == "qwen3_moe":
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.moe_topk, decoder_sparse_step=1,
                   moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=spec.norm_topk_prob,
                   mlp_only_layers=[], router_aux_loss_coef=0.0)
    elif model_type == "mixtral":
        cfg.update(num_local_experts=spec.num_experts, num_experts_per_tok=spec.moe_topk,
                   intermediate_size=spec.moe_intermediate_size, router_jitter_noise=0.0, sliding_window=None,
                   router_aux_loss_coef=0.0)
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        cfg.update(attention_bias=False, use_sliding_window=False, **({"mlp_bias": False} if model_type == "llama"
                                                                      else {}))
    elif model_type == "qwen2" and not spec.qkv_bias:
        raise UnsupportedConfigError("qkv_bias", False, "Qwen2 always has q/k/v biases; export as llama")
    return cfg


def spec_to_dict(spec: GPTSpec) -> dict:
    return asdict(spec)


def spec_from_dict(d: dict) -> GPTSpec:
    return GPTSpec(**d)
