"""Where vLLM stores each HF tensor of a Qwen2/Qwen3/Llama or Qwen3-MoE/Mixtral model on one TP rank, for the read-back check.

Unquantized models as vLLM 0.33's model classes register them (vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py, fused_moe/routed_experts.py); tests/data/vllm_0_33_names.json holds the names and
shapes of the tiny test models, derived from that source:
  qkv_proj (QKVParallelLinear)          [q_r; k_r; v_r]: this rank's H/tp query heads, then its KV
                                        heads (KV/tp of them, or 1 replicated head, index r // (tp/KV))
  gate_up_proj (MergedColumnParallel)   [gate_r; up_r], f/tp rows each
  o_proj, down_proj (RowParallel)       columns [r*c/tp, (r+1)*c/tp) of the HF matrix
  embed_tokens, lm_head (vocab parallel) rows [r*p, (r+1)*p) of the vocabulary padded to 64 (p =
                                        padded/tp), in the parameter's first rows; the rest is zero
  layer norms, final norm, q/k norms    replicated
  MoE (no expert parallel)              ...experts.<sub>w13_weight [E, 2f/tp, H]: expert e's [gate_r; up_r];
                                        ...experts.<sub>w2_weight [E, H, f/tp]: its down_proj columns of rank r;
                                        <sub> is "routed_experts." from vLLM 0.25 on, "" before: found by suffix;
                                        the router (gate) replicated
Sizes come from the spec and are checked against the parameter: a kernel layout that pads or reorders (a
non-Triton MoE backend) is refused, never read at the wrong offset.
Pure functions over a {name: parameter} dict (the worker's `model.named_parameters()`); no vLLM import.
"""
from __future__ import annotations

import re

import torch

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec

VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE."""
FUSED_EXPERTS = ("w13_weight", "w2_weight")
"""The leaf names of vLLM's fused expert parameters (unquantized)."""

_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")


def _param(params: dict, name: str, shape: tuple) -> torch.Tensor:
    if name not in params:
        raise KeyError(f"vLLM model has no parameter {name!r} (unquantized layout of a supported family expected)")
    param = params[name]
    if tuple(param.shape) != tuple(shape):
        raise ValueError(f"vLLM stores {name!r} as {tuple(param.shape)}, not {tuple(shape)}: a kernel layout that "
                         "pads or reorders it (a non-Triton MoE backend?) cannot be read back; use moe_backend=triton")
    return param


def expert_params(params: dict) -> dict[str, dict[str, str]]:
    """{HF experts prefix, e.g. "model.layers.0.mlp.experts.": {"w13_weight": vLLM name, "w2_weight": ...}},
    matched by suffix as NeMo-RL does, whatever submodule vLLM keeps them in."""
    out: dict[str, dict[str, str]] = {}
    for name in params:
        at, leaf = name.find(".experts."), name.rpartition(".")[2]
        if at < 0 or leaf not in FUSED_EXPERTS:
            continue
        found = out.setdefault(name[:at + len(".experts.")], {})
        if leaf in found:
            raise KeyError(f"two vLLM parameters end in {leaf!r} under one MoE layer: {found[leaf]!r}, {name!r}")
        found[leaf] = name
    return out


def _expert_slice(m, params: dict, spec: GPTSpec, tp: int, rank: int, experts: dict):
    """An HF expert matrix inside vLLM's fused w13 / w2 expert parameters."""
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    names = experts.get(prefix, {})
    leaf = "w2_weight" if kind in ("down_proj", "w2") else "w13_weight"
    if leaf not in names:
        raise KeyError(f"vLLM model has no parameter ending in {leaf!r} under {prefix!r} (for {m.group(0)!r})")
    E, h, per = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size // tp
    if leaf == "w2_weight":
        return _param(params, names[leaf], (E, h, per))[e], (1, rank * per, (rank + 1) * per)
    at = per if kind in ("up_proj", "w3") else 0
    return _param(params, names[leaf], (E, 2 * per, h))[e, at:at + per], (0, rank * per, (rank + 1) * per)


def stored_slice(hf_name: str, params: dict, spec: GPTSpec, tp: int, rank: int, experts: dict | None = None):
    """(view of the vLLM parameter holding it, region (dim, start, stop) of the HF tensor or None).
    `experts`: `expert_params(params)`, computed once per load by the caller (else here, per call)."""
    expert = _EXPERT.match(hf_name)
    if expert:
        return _expert_slice(expert, params, spec, tp, rank, expert_params(params) if experts is None else experts)
    module, leaf = hf_name.rsplit(".", 2)[-2:]
    h, d, kv = spec.hidden_size, spec.kv_channels, spec.num_key_value_heads
    if hf_name in (hc.HF_EMBEDDING, hc.HF_LM_HEAD):
        per = -(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // tp
        start = min(rank * per, spec.vocab_size)
        rows = min(start + per, spec.vocab_size) - start
        return _param(params, hf_name, (per, h))[:rows], (0, start, start + rows)
    if module in ("q_proj", "k_proj", "v_proj"):
        q_rows = spec.num_attention_heads // tp * d
        kv_rows, kv_index = (kv // tp * d, rank) if tp < kv else (d, rank // (tp // kv))
        shape = (q_rows + 2 * kv_rows,) + ((h,) if leaf == "weight" else ())
        qkv = _param(params, hf_name.replace(f"{module}.{leaf}", f"qkv_proj.{leaf}"), shape)
        if module == "q_proj":
            return qkv[:q_rows], (0, rank * q_rows, (rank + 1) * q_rows)
        at = q_rows + (kv_rows if module == "v_proj" else 0)
        return qkv[at:at + kv_rows], (0, kv_index * kv_rows, (kv_index + 1) * kv_rows)
    if module in ("gate_proj", "up_proj"):
        per = spec.intermediate_size // tp
        fused = _param(params, hf_name.replace(f"{module}.", "gate_up_proj."), (2 * per, h))
        at = per if module == "up_proj" else 0
        return fused[at:at + per], (0, rank * per, (rank + 1) * per)
    if module in ("o_proj", "down_proj"):
        per = (spec.num_attention_heads * d if module == "o_proj" else spec.intermediate_size) // tp
        return _param(params, hf_name, (h, per)), (1, rank * per, (rank + 1) * per)
    param = params.get(hf_name)
    if param is None:
        raise KeyError(f"vLLM model has no parameter {hf_name!r} (unquantized layout of a supported family expected)")
    return param, None
