"""Writes tests/data/vllm_0_33_names.json: the parameter names and shapes vLLM 0.33 gives the tiny test models
(`random_hf_model_folder`'s Qwen2, Qwen3, Llama, Qwen3-MoE, Mixtral, and a tied Qwen2 with one KV head) at TP 1
and 2, and where its weight loaders copy each HF tensor on each rank.

    python tests/vllm_033_names.py          # rewrite the fixture (nothing of vLLM is imported)

Derived by hand from vLLM 0.33.0's source (the PyPI wheel, commit g4ba787ec9), independently of
`hybridrl.rollout.vllm_layout` (which the tests check against it), from the modules the model classes register
and the loaders those modules carry:
  models/{qwen2,qwen3,llama,qwen3_moe,mixtral}.py  module tree; WeightsMapper.orig_to_new_stacked maps
      q/k/v_proj -> qkv_proj ("q", "k", "v") and gate/up_proj -> gate_up_proj (0, 1); Qwen2Attention takes
      head_dim = hidden / heads, the others config.head_dim or that; q_norm / k_norm on Qwen3(-MoE);
      qkv bias on Qwen2 only (attention_bias false elsewhere); lm_head tied to embed_tokens shares one
      Parameter (named_parameters lists it once, as embed_tokens)
  layers/linear.py, parameter.py  QKVParallelLinear: num_heads = H/tp, num_kv_heads = max(1, KV/tp),
      replicas = tp/KV when tp >= KV; rows [q | k | v]; load_qkv_weight narrows the HF tensor at
      shard index tp_rank (q) or tp_rank // replicas (k, v); MergedColumnParallelLinear [gate | up], each
      the rank's rows; RowParallelLinear (o_proj, down_proj) the rank's input columns
  layers/vocab_parallel_embedding.py  rows padded to a multiple of 64 (pad_vocab_size), split over TP
      (padded/tp each); rank r loads vocabulary rows [r*p, min((r+1)*p, V)) into its first rows and
      zero-fills the rest
  layers/fused_moe/{layer.py,routed_experts.py,unquantized_fused_moe_method.py}  FusedMoE returns a
      MoERunner whose `routed_experts` submodule registers w13_weight [E, 2*f/tp, H] and w2_weight
      [E, H, f/tp] (f = moe_intermediate_size; Mixtral: intermediate_size); _load_w13 puts gate (w1) in the
      first half, up (w3) in the second, each the rank's f/tp rows; _load_w2 the rank's down columns; the
      router `gate` (GateLinear, a ReplicatedLinear) is whole on every rank
Regenerate on a GPU with vLLM installed: benchmarks/gpu_vllm_check.py names compares these shapes with a
real engine's (load_format="dummy").
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vllm_0_33_names.json")
CASES = {"qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}), "llama": ("llama", {}), "qwen3_moe": ("qwen3_moe", {}),
         "mixtral": ("mixtral", {}), "qwen2_kv1_tied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True))}
TPS = (1, 2)
DERIVATION = __doc__.split("\n\n")[2].strip()


def _span(dim, start, size):
    return [dim, start, start + size]


def _attention(c: dict, tp: int, p: str, params: dict, loads: dict) -> None:
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads if c["model_type"] == "qwen2" else (c.get("head_dim") or h // heads)
    q, kv_heads = heads // tp * d, max(1, kv // tp)
    replicas = tp // kv if tp >= kv else 1
    leaves = ("weight", "bias") if c["model_type"] == "qwen2" else ("weight",)
    for leaf in leaves:
        params[f"{p}self_attn.qkv_proj.{leaf}"] = [q + 2 * kv_heads * d] + ([h] if leaf == "weight" else [])
        for proj, at in (("q_proj", 0), ("k_proj", q), ("v_proj", q + kv_heads * d)):
            size = q if proj == "q_proj" else kv_heads * d
            loads[f"{p}self_attn.{proj}.{leaf}"] = [
                dict(param=f"{p}self_attn.qkv_proj.{leaf}", index=None, into=_span(0, at, size),
                     src=_span(0, (r if proj == "q_proj" else r // replicas) * size, size), zero_rest=False)
                for r in range(tp)]
    params[f"{p}self_attn.o_proj.weight"] = [h, heads * d // tp]
    loads[f"{p}self_attn.o_proj.weight"] = [dict(param=f"{p}self_attn.o_proj.weight", index=None,
                                                 into=_span(1, 0, heads * d // tp),
                                                 src=_span(1, r * heads * d // tp, heads * d // tp), zero_rest=False)
                                            for r in range(tp)]
    if c["model_type"] in ("qwen3", "qwen3_moe"):
        for norm in ("q_norm", "k_norm"):
            _whole(f"{p}self_attn.{norm}.weight", [d], tp, params, loads)


def _whole(name: str, shape: list, tp: int, params: dict, loads: dict, hf_name: str | None = None) -> None:
    params[name] = shape
    loads[hf_name or name] = [dict(param=name, index=None, into=None, src=None, zero_rest=False)] * tp


def _mlp(c: dict, tp: int, p: str, params: dict, loads: dict) -> None:
    h, f = c["hidden_size"], c["intermediate_size"] // tp
    params[f"{p}mlp.gate_up_proj.weight"], params[f"{p}mlp.down_proj.weight"] = [2 * f, h], [h, f]
    for proj, at in (("gate_proj", 0), ("up_proj", f)):
        loads[f"{p}mlp.{proj}.weight"] = [dict(param=f"{p}mlp.gate_up_proj.weight", index=None, into=_span(0, at, f),
                                               src=_span(0, r * f, f), zero_rest=False) for r in range(tp)]
    loads[f"{p}mlp.down_proj.weight"] = [dict(param=f"{p}mlp.down_proj.weight", index=None, into=_span(1, 0, f),
                                              src=_span(1, r * f, f), zero_rest=False) for r in range(tp)]


def _moe(c: dict, tp: int, p: str, params: dict, loads: dict) -> None:
    mixtral = c["model_type"] == "mixtral"
    block, (gate, down, up) = ("block_sparse_moe", ("w1", "w2", "w3")) if mixtral else \
        ("mlp", ("gate_proj", "down_proj", "up_proj"))
    E = c.get("num_local_experts") or c["num_experts"]  # transformers 5 saves Qwen3-MoE's num_experts under this name
    h, f = c["hidden_size"], (c["intermediate_size"] if mixtral else c["moe_intermediate_size"]) // tp
    _whole(f"{p}{block}.gate.weight", [E, h], tp, params, loads)
    w13, w2 = f"{p}{block}.experts.routed_experts.w13_weight", f"{p}{block}.experts.routed_experts.w2_weight"
    params[w13], params[w2] = [E, 2 * f, h], [E, h, f]
    for e in range(E):
        hf = f"{p}{block}.experts.{e}."
        for kind, at in ((gate, 0), (up, f)):
            loads[f"{hf}{kind}.weight"] = [dict(param=w13, index=e, into=_span(0, at, f), src=_span(0, r * f, f),
                                                zero_rest=False) for r in range(tp)]
        loads[f"{hf}{down}.weight"] = [dict(param=w2, index=e, into=_span(1, 0, f), src=_span(1, r * f, f),
                                            zero_rest=False) for r in range(tp)]


def derive(c: dict, tp: int) -> dict:
    """{"params": {vLLM name: shape}, "loads": {HF name: [per rank {param, index, into, src, zero_rest}]}}."""
    params, loads = {}, {}
    h, vocab = c["hidden_size"], c["vocab_size"]
    rows = -(-vocab // 64) * 64 // tp
    heads = ["model.embed_tokens.weight"] + ([] if c.get("tie_word_embeddings") else ["lm_head.weight"])
    for name in heads:
        params[name] = [rows, h]
        spans = [(min(r * rows, vocab), min((r + 1) * rows, vocab) - min(r * rows, vocab)) for r in range(tp)]
        loads[name] = [dict(param=name, index=None, into=_span(0, 0, n), src=_span(0, s, n), zero_rest=True)
                       for s, n in spans]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        _whole(f"{p}input_layernorm.weight", [h], tp, params, loads)
        _attention(c, tp, p, params, loads)
        _whole(f"{p}post_attention_layernorm.weight", [h], tp, params, loads)
        (_moe if c["model_type"] in ("qwen3_moe", "mixtral") else _mlp)(c, tp, p, params, loads)
    _whole("model.norm.weight", [h], tp, params, loads)
    return {"params": params, "loads": loads}


def tiny_configs() -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (family, sizes) in CASES.items():
            folder = random_hf_model_folder(os.path.join(tmp, case), family, **sizes)
            with open(os.path.join(folder, "config.json")) as f:
                out[case] = json.load(f)
    return out


def build(configs: dict) -> dict:
    models = {f"{case}/tp{tp}": dict(hf_config=cfg, tp=tp, **derive(cfg, tp))
              for case, cfg in configs.items() for tp in TPS}
    return {"vllm": "0.33.0 (PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64, commit g4ba787ec9)",
            "derivation": DERIVATION, "generator": "tests/vllm_033_names.py",
            "entry": "loads[hf_name][rank]: param (vLLM name), index (expert, or null), into [dim, start, stop] of "
                     "param[index] (null: all of it), src [dim, start, stop] of the HF tensor (null: all of it), "
                     "zero_rest (the rows after `into` are zero-filled)",
            "models": models}


if __name__ == "__main__":
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    with open(FIXTURE, "w") as f:
        json.dump(build(tiny_configs()), f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {FIXTURE}")
