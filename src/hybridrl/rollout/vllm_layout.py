"""Where vLLM stores each HF tensor of a Qwen2/Qwen3/Llama or Qwen3-MoE/Mixtral model on one TP rank, for the read-back check.

Unquantized models, following vLLM's parallel layers (vllm/model_executor/layers/linear.py and
vocab_parallel_embedding.py), which its Qwen2 / Llama `load_weights` fill from HF tensors:
  qkv_proj (QKVParallelLinear)          [q_r; k_r; v_r]: this rank's H/tp query heads, then its KV
                                        heads (KV/tp of them, or 1 replicated head, index r // (tp/KV))
  gate_up_proj (MergedColumnParallel)   [gate_r; up_r], f/tp rows each
  o_proj, down_proj (RowParallel)       columns [r*c/tp, (r+1)*c/tp) of the HF matrix
  embed_tokens, lm_head (vocab parallel) rows [r*p, (r+1)*p) of the vocabulary padded to 64 (p =
                                        padded/tp), in the parameter's first rows; the rest is zero
  layer norms, final norm, q/k norms    replicated
  MoE (FusedMoE, no expert parallel)    experts.w13_weight [E, 2f/tp, H]: expert e's [gate_r; up_r];
                                        experts.w2_weight [E, H, f/tp]: its down_proj columns of rank r;
                                        the router (gate, ReplicatedLinear) replicated
Pure functions over a {name: parameter} dict (the worker's `model.named_parameters()`); no vLLM import.
"""
from __future__ import annotations

import re

import torch

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec

VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE."""


def _param(params: dict, name: str) -> torch.Tensor:
    if name not in params:
        raise KeyError(f"vLLM model has no parameter {name!r} (unquantized layout of a supported family expected)")
    return params[name]


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")


def _expert_slice(m, params: dict, rank: int):
    """An HF expert matrix inside vLLM's fused w13 / w2 expert parameters."""
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind in ("down_proj", "w2"):
        param = _param(params, f"{prefix}w2_weight")[e]
        per = param.shape[1]
        return param, (1, rank * per, (rank + 1) * per)
    fused = _param(params, f"{prefix}w13_weight")[e]
    per = fused.shape[0] // 2
    at = per if kind in ("up_proj", "w3") else 0
    return fused[at:at + per], (0, rank * per, (rank + 1) * per)


def stored_slice(hf_name: str, params: dict, spec: GPTSpec, tp: int, rank: int):
    """(view of the vLLM parameter holding it, region (dim, start, stop) of the HF tensor or None)."""
    expert = _EXPERT.match(hf_name)
    if expert:
        return _expert_slice(expert, params, rank)
    module, leaf = hf_name.rsplit(".", 2)[-2:]
    if hf_name in (hc.HF_EMBEDDING, hc.HF_LM_HEAD):
        per = -(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // tp
        start = min(rank * per, spec.vocab_size)
        rows = min(start + per, spec.vocab_size) - start
        return _param(params, hf_name)[:rows], (0, start, start + rows)
    if module in ("q_proj", "k_proj", "v_proj"):
        qkv = _param(params, hf_name.replace(f"{module}.{leaf}", f"qkv_proj.{leaf}"))
        d, kv = spec.kv_channels, spec.num_key_value_heads
        q_rows = spec.num_attention_heads // tp * d
        if module == "q_proj":
            return qkv[:q_rows], (0, rank * q_rows, (rank + 1) * q_rows)
        kv_rows, kv_index = (kv // tp * d, rank) if tp < kv else (d, rank // (tp // kv))
        at = q_rows + (kv_rows if module == "v_proj" else 0)
        return qkv[at:at + kv_rows], (0, kv_index * kv_rows, (kv_index + 1) * kv_rows)
    if module in ("gate_proj", "up_proj"):
        fused = _param(params, hf_name.replace(f"{module}.", "gate_up_proj."))
        per = fused.shape[0] // 2
        at = per if module == "up_proj" else 0
        return fused[at:at + per], (0, rank * per, (rank + 1) * per)
    if module in ("o_proj", "down_proj"):
        param = _param(params, hf_name)
        per = param.shape[1]
        return param, (1, rank * per, (rank + 1) * per)
    return _param(params, hf_name), None
