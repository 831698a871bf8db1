"""HF <-> megatron-core tensor mapping: names, fused QKV / gate-up layouts, vocab padding, TP split/merge
and PP layer offsets. Pure functions on tensors (no I/O, no torch.distributed), shared by the
checkpoint loader (`hf_checkpoint.py`) and the resharder that streams weights into rollout engines.

Megatron state-dict names of the local spec (`get_gpt_layer_local_spec`), global layer index i:
  embedding.word_embeddings.weight              <- model.embed_tokens.weight            [V_pad, H], TP dim 0
  decoder.layers.i.input_layernorm.weight       <- model.layers.i.input_layernorm.weight          replicated
  decoder.layers.i.self_attention.linear_qkv.{weight,bias} <- q_proj, k_proj, v_proj  fused, TP dim 0
  decoder.layers.i.self_attention.linear_proj.weight      <- o_proj.weight                        TP dim 1
  decoder.layers.i.pre_mlp_layernorm.weight     <- post_attention_layernorm.weight                replicated
  decoder.layers.i.mlp.linear_fc1.weight        <- [gate_proj; up_proj]                  TP dim 0 per half
  decoder.layers.i.mlp.linear_fc2.weight        <- down_proj.weight                               TP dim 1
  decoder.final_layernorm.weight                <- model.norm.weight                               replicated
  output_layer.weight                           <- lm_head.weight (tied: a copy of embed_tokens, which
                                                   exists only on the last stage when PP > 1), TP dim 0
Fused QKV rows, per query group g: [the q heads of g; k_g; v_g], so a contiguous TP chunk holds whole
groups. (`_extra_state` entries of the state dict carry no weights and are not mapped.)
The Transformer Engine spec (`GPTSpec.layer_spec == "te"`) fuses each layernorm into the linear after
it, so two names differ (megatron's own local->TE map, `sharded_state_dict_keys_map` of the local spec):
  decoder.layers.i.input_layernorm.weight   -> decoder.layers.i.self_attention.linear_qkv.layer_norm_weight
  decoder.layers.i.pre_mlp_layernorm.weight -> decoder.layers.i.mlp.linear_fc1.layer_norm_weight
Both stay replicated over TP; everything else is named and laid out as above.
Qwen3 adds per-head q/k RMSNorms (replicated): self_attention.{q,k}_layernorm.weight <- self_attn.{q,k}_norm.weight.
MoE layers (Qwen3-MoE, Mixtral; `spec.num_experts` > 0) replace the two MLP tensors by the router
(mlp.router.weight [E, H], replicated <- mlp.gate / block_sparse_moe.gate) and, per expert e, the same
fused fc1 / fc2 pair (<- experts.e.{gate,up,down}_proj, Mixtral experts.e.{w1,w3,w2}) named
mlp.experts.local_experts.e.linear_fc{1,2}.weight (local spec; TE's grouped experts:
mlp.experts.linear_fc{1,2}.weight<e>, its pre-MLP norm unfused). Expert tensors are split over TP as the
dense MLP is (expert TP = TP). Global names carry the global expert index; an EP rank holds experts
[r*E/ep, (r+1)*E/ep) under local indices from 0, as pipeline stages hold layers.
"""
from __future__ import annotations

import functools
import re
from typing import Mapping, Protocol

import torch

from hybridrl.models.gpt import GPTSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# per-layer megatron suffix -> HF suffixes under model.layers.i.
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
# the TE spec's names of the two per-layer norms (everything else is shared with the local spec)
_TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_LAYER_MAPS = {"local": _LAYER_MAP, "te": {_TE_NORMS.get(k, k): v for k, v in _LAYER_MAP.items()}}
_QK_NORMS = {"self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
             "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",)}
# HF names of the router and of one expert's (gate, up, down) in the two MoE families
_MOE_HF = {"qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
           "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))}
_EXPERT = re.compile(r"^(.*mlp\.experts\.)(local_experts\.(\d+)\.(linear_fc[12]\.weight)|(linear_fc[12]\.weight)(\d+))$")
ROUTER = "mlp.router.weight"


def _expert_key(spec: GPTSpec, e: int, fc: str) -> str:
    return f"mlp.experts.linear_{fc}.weight{e}" if spec.layer_spec == "te" else \
        f"mlp.experts.local_experts.{e}.linear_{fc}.weight"


def _layer_map(spec: GPTSpec, experts: range | None = None) -> dict[str, tuple[str, ...]]:
    """Per-layer megatron suffix -> HF suffixes for `spec` (MoE: experts `experts`, default all)."""
    base = _LAYER_MAPS[spec.layer_spec]
    out = {k: v for k, v in base.items() if spec.qkv_bias or not k.endswith("linear_qkv.bias")}
    if spec.qk_norm:
        out.update(_QK_NORMS)
    if not spec.is_moe:
        return out
    # the pre-MLP norm is its own module in front of the router (TE fuses it only into a dense fc1)
    out = {("pre_mlp_layernorm.weight" if k == _TE_NORMS["pre_mlp_layernorm.weight"] else k): v
           for k, v in out.items() if k not in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")}
    router, expert, (gate, up, down) = _MOE_HF[spec.moe_hf_names]
    out[ROUTER] = (router,)
    for e in experts if experts is not None else range(spec.num_experts):
        hf = expert.format(e=e)
        out[_expert_key(spec, e, "fc1")] = (f"{hf}{gate}.weight", f"{hf}{up}.weight")
        out[_expert_key(spec, e, "fc2")] = (f"{hf}{down}.weight",)
    return out


@functools.lru_cache(maxsize=None)  # names and specs are few: every handoff asks again
def expert_index(name: str) -> int | None:
    """The expert index in a megatron expert tensor's name (None: not an expert tensor)."""
    m = _EXPERT.match(name)
    return None if not m else int(m.group(3) if m.group(3) is not None else m.group(6))


def expert_range(spec: GPTSpec, ep: int, ep_rank: int) -> range:
    """Global experts held by expert-parallel rank `ep_rank`."""
    if spec.num_experts % ep:
        raise ValueError(f"num_experts={spec.num_experts} is not divisible by expert_model_parallel_size={ep}")
    per = spec.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def owner_ep_rank(global_name: str, spec: GPTSpec, ep: int) -> int | None:
    """The EP rank holding an expert tensor; None for everything else (replicated over EP)."""
    e = expert_index(global_name)
    return None if e is None else e // (spec.num_experts // ep)
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM, OUTPUT = "decoder.final_layernorm.weight", "output_layer.weight"
HF_EMBEDDING, HF_LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_TOP_MAP = {EMBEDDING: (HF_EMBEDDING,), FINAL_NORM: ("model.norm.weight",), OUTPUT: (HF_LM_HEAD,)}


class TensorReader(Protocol):
    """Read access to named tensors, optionally a [start, stop) range along one dim."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor: ...


class DictReader:
    """A TensorReader over an in-memory {name: tensor} dict."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)


# ---- names and PP layout -------------------------------------------------------------------------

def layer_range(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global layer indices held by pipeline stage `pp_rank`: [r*L/pp, (r+1)*L/pp)."""
    if num_layers % pp:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp={pp}")
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _shift_expert(name: str, delta: int) -> str:
    m = _EXPERT.match(name)
    if not m or not delta:
        return name
    if m.group(3) is not None:
        return f"{m.group(1)}local_experts.{int(m.group(3)) + delta}.{m.group(4)}"
    return f"{m.group(1)}{m.group(5)}{int(m.group(6)) + delta}"


def _shift_layer(name: str, delta: int, expert_delta: int = 0) -> str:
    m = _LAYER.match(name)
    return _shift_expert(f"decoder.layers.{int(m.group(1)) + delta}.{m.group(2)}", expert_delta) if m else name


def local_to_global(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    return _shift_layer(name, layer_offset, expert_offset)


def global_to_local(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    return _shift_layer(name, -layer_offset, -expert_offset)


def owner_stage(global_name: str, spec: GPTSpec, pp: int) -> int:
    """The pipeline stage holding a (non-duplicated) megatron tensor."""
    m = _LAYER.match(global_name)
    if m:
        return int(m.group(1)) // (spec.num_layers // pp)
    return 0 if global_name == EMBEDDING else pp - 1


def stage_names(spec: GPTSpec, pp: int, pp_rank: int, head: str = "lm", ep: int = 1,
                ep_rank: int = 0) -> list[tuple[str, str]]:
    """(local, global) megatron names of the weights on stage `pp_rank` and expert-parallel rank `ep_rank`;
    head "lm" or "none" (trunk)."""
    rng = layer_range(spec.num_layers, pp, pp_rank)
    experts = expert_range(spec, ep, ep_rank) if spec.is_moe else None
    layer_keys = list(_layer_map(spec, experts))
    shift = experts.start if experts else 0
    names = [(EMBEDDING, EMBEDDING)] if pp_rank == 0 else []
    names += [(global_to_local(f"decoder.layers.{i}.{k}", rng.start, shift), f"decoder.layers.{i}.{k}")
              for i in rng for k in layer_keys]
    if pp_rank == pp - 1:
        names.append((FINAL_NORM, FINAL_NORM))
        # tied at PP=1: the head reuses the embedding; at PP>1 the last stage keeps its own copy
        if head == "lm" and (not spec.tie_word_embeddings or pp > 1):
            names.append((OUTPUT, OUTPUT))
    return names


@functools.lru_cache(maxsize=None)  # names and specs are few: every handoff asks again
def hf_sources(global_name: str, spec: GPTSpec) -> tuple[str, ...]:
    """HF tensor names that make up one megatron tensor (in fused order)."""
    if global_name == OUTPUT and spec.tie_word_embeddings:
        return (HF_EMBEDDING,)
    if global_name in _TOP_MAP:
        return _TOP_MAP[global_name]
    m = _LAYER.match(global_name)
    e = expert_index(global_name)
    layer_map = _layer_map(spec, range(e, e + 1) if e is not None else range(0))
    if not m or m.group(2) not in layer_map:
        raise KeyError(f"no HF counterpart for megatron tensor {global_name!r} ({spec.layer_spec} layer spec)")
    return tuple(f"model.layers.{m.group(1)}.{s}" for s in layer_map[m.group(2)])


def hf_to_mcore_name_map(spec: GPTSpec, head: str = "lm") -> dict[str, tuple[str, ...]]:
    """Every unique megatron tensor (global names, model order) -> its HF source names (a new dict each call)."""
    return dict(_name_pairs(spec, head))


def mcore_to_hf_name_map(spec: GPTSpec, head: str = "lm") -> dict[str, tuple[str, int]]:
    """HF name -> (megatron global name, position inside the fused tensor)."""
    return {hf: (g, i) for g, srcs in _name_pairs(spec, head) for i, hf in enumerate(srcs)}


@functools.lru_cache(maxsize=None)
def _name_pairs(spec: GPTSpec, head: str) -> tuple:
    return tuple((g, hf_sources(g, spec)) for _, g in stage_names(spec, 1, 0, head))


def hf_shapes(spec: GPTSpec, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor of a checkpoint with this spec (lm_head omitted when tied)."""
    h, d, i_size = spec.hidden_size, spec.kv_channels, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    per_layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
                 "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                 "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (i_size, h), "mlp.up_proj.weight": (i_size, h),
                 "mlp.down_proj.weight": (h, i_size)}
    if spec.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if spec.is_moe:
        per_layer = {k: v for k, v in per_layer.items() if not k.startswith("mlp.")}
        router, expert, (gate, up, down) = _MOE_HF[spec.moe_hf_names]
        per_layer[router] = (spec.num_experts, h)
        m_size = spec.moe_intermediate_size
        for e in range(spec.num_experts):
            hf = expert.format(e=e)
            per_layer.update({f"{hf}{gate}.weight": (m_size, h), f"{hf}{up}.weight": (m_size, h),
                              f"{hf}{down}.weight": (h, m_size)})
    if spec.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    shapes = {HF_EMBEDDING: (spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        shapes.update({f"model.layers.{layer}.{k}": s for k, s in per_layer.items()})
    shapes["model.norm.weight"] = (h,)
    if head == "lm" and not spec.tie_word_embeddings:
        shapes[HF_LM_HEAD] = (spec.vocab_size, h)
    return shapes


# ---- fused layouts and vocab padding ---------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """[q; k; v] (HF, weight or bias) -> megatron's per-group [q_g; k_g; v_g] layout."""
    rest = q.shape[1:]
    parts = [t.reshape(num_query_groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unfuse_qkv(qkv: torch.Tensor, num_query_groups: int, heads_per_group: int):
    """Inverse of `fuse_qkv`: (q, k, v) with HF row order."""
    rest = qkv.shape[1:]
    head_dim = qkv.shape[0] // (num_query_groups * (heads_per_group + 2))
    grouped = qkv.reshape(num_query_groups, heads_per_group + 2, head_dim, *rest)
    q, k, v = grouped.split([heads_per_group, 1, 1], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def unfuse_gate_up(fc1: torch.Tensor):
    return fc1.chunk(2, dim=0)


def pad_vocab(t: torch.Tensor, padded_size: int) -> torch.Tensor:
    """Zero rows appended up to `padded_size` (megatron pads the vocab to 128 x TP)."""
    if t.shape[0] > padded_size:
        raise ValueError(f"vocab rows {t.shape[0]} exceed the padded size {padded_size}")
    return torch.cat([t, t.new_zeros(padded_size - t.shape[0], *t.shape[1:])]) if t.shape[0] < padded_size else t


def strip_vocab(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return t[:vocab_size]


def is_vocab_tensor(name: str) -> bool:
    return name in (EMBEDDING, OUTPUT)


@functools.lru_cache(maxsize=None)  # names and specs are few: every handoff asks again
def mcore_full_shape(global_name: str, spec: GPTSpec, tp: int = 1) -> tuple[int, ...]:
    """Shape of a full (TP-merged) megatron tensor; vocab rows padded for `tp`."""
    h, d = spec.hidden_size, spec.kv_channels
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d
    if is_vocab_tensor(global_name):
        return (spec.padded_vocab_size(tp), h)
    if global_name.endswith(ROUTER):
        return (spec.num_experts, h)
    if global_name.endswith("layernorm.weight") and "_attention." in global_name:  # q/k norm: per head
        return (d,)
    if expert_index(global_name) is not None:
        m_size = spec.moe_intermediate_size
        return (2 * m_size, h) if is_fc1(global_name) else (h, m_size)
    suffix = {"linear_qkv.weight": (qkv, h), "linear_qkv.bias": (qkv,),
              "linear_proj.weight": (h, spec.num_attention_heads * d),
              "linear_fc1.weight": (2 * spec.intermediate_size, h),
              "linear_fc2.weight": (h, spec.intermediate_size)}
    for end, shape in suffix.items():
        if global_name.endswith(end):
            return shape
    return (h,)  # the RMSNorm weights


def held_dtype(global_name: str, spec: GPTSpec, dtype: torch.dtype) -> torch.dtype:
    """The dtype a megatron tensor is held in, in a model of `dtype` built with `spec`'s layer spec: the local
    spec's norms are torch RMSNorms whose fp32 weights nothing casts (no Float16Module here); every other tensor,
    and Transformer Engine's norms, `dtype`. What a pipeline stage receives a tensor it does not hold into."""
    return torch.float32 if spec.layer_spec != "te" and global_name.endswith("layernorm.weight") else dtype


# ---- TP split / merge ------------------------------------------------------------------------------

def is_fc1(name: str) -> bool:
    """A gate/up weight ([gate; up] fused): a dense MLP's or an expert's, TE's grouped experts (`...weight<e>`) too."""
    return name.endswith("linear_fc1.weight") or (expert_index(name) is not None and "linear_fc1.weight" in name)


@functools.lru_cache(maxsize=None)  # names and specs are few: every handoff asks again
def tp_split_dim(name: str) -> int | None:
    """Dim a megatron tensor is partitioned along over TP (column-parallel 0, row-parallel 1), None: replicated."""
    if is_vocab_tensor(name) or is_fc1(name) or name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")) or \
            (expert_index(name) is not None and "linear_fc2.weight" in name):
        return 1
    return None


def split_for_tp(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a full megatron-layout tensor (vocab already padded for `tp`)."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(full.shape)} is not divisible by tp={tp}")
    if is_fc1(name):  # each rank holds [gate_shard; up_shard]
        gate, up = unfuse_gate_up(full)
        return fuse_gate_up(gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank])
    return full.chunk(tp, dim=dim)[tp_rank]


def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_for_tp` over all TP ranks' shards (in rank order)."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if is_fc1(name):
        halves = [unfuse_gate_up(s) for s in shards]
        return fuse_gate_up(torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves]))
    return torch.cat(shards, dim=dim)


# ---- whole-tensor conversion -----------------------------------------------------------------------

def hf_to_mcore(global_name: str, hf: Mapping[str, torch.Tensor], spec: GPTSpec, tp: int = 1) -> torch.Tensor:
    """The full megatron tensor (fused; vocab padded for `tp`) from its HF tensors."""
    srcs = [hf[n] for n in hf_sources(global_name, spec)]
    if is_vocab_tensor(global_name):
        return pad_vocab(srcs[0], spec.padded_vocab_size(tp))
    if len(srcs) == 3:
        return fuse_qkv(*srcs, spec.num_key_value_heads)
    if len(srcs) == 2:
        return fuse_gate_up(*srcs)
    return srcs[0]


def mcore_to_hf(global_name: str, full: torch.Tensor, spec: GPTSpec) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs from a full (TP-merged) megatron tensor; strips vocab padding."""
    names = hf_sources(global_name, spec)
    if is_vocab_tensor(global_name):
        return [(names[0], strip_vocab(full, spec.vocab_size))]
    if len(names) == 3:
        hpg = spec.num_attention_heads // spec.num_key_value_heads
        parts = unfuse_qkv(full, spec.num_key_value_heads, hpg)
    elif len(names) == 2:
        parts = unfuse_gate_up(full)
    else:
        parts = (full,)
    return list(zip(names, parts))


def read_shard(global_name: str, reader: TensorReader, spec: GPTSpec, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of a megatron tensor, reading only the needed rows/columns from `reader`."""
    srcs = hf_sources(global_name, spec)
    if is_vocab_tensor(global_name):
        per = spec.padded_vocab_size(tp) // tp
        start = tp_rank * per
        stop = min(start + per, spec.vocab_size)
        rows = reader.read(srcs[0], 0, start, stop) if start < stop else None
        if rows is None:  # a rank holding only padding rows
            return torch.zeros(per, spec.hidden_size, dtype=_dtype(reader, srcs[0]))
        return pad_vocab(rows, per)
    dim = tp_split_dim(global_name)
    if dim is None:
        return reader.read(srcs[0])
    if len(srcs) == 3:
        groups = spec.num_key_value_heads // tp
        q_rows = groups * spec.num_attention_heads // spec.num_key_value_heads * spec.kv_channels
        kv_rows = groups * spec.kv_channels
        q = reader.read(srcs[0], 0, tp_rank * q_rows, (tp_rank + 1) * q_rows)
        k, v = (reader.read(n, 0, tp_rank * kv_rows, (tp_rank + 1) * kv_rows) for n in srcs[1:])
        return fuse_qkv(q, k, v, groups)
    per = reader.shape(srcs[0])[dim] // tp
    parts = [reader.read(n, dim, tp_rank * per, (tp_rank + 1) * per) for n in srcs]
    return fuse_gate_up(*parts) if len(parts) == 2 else parts[0]


def shard_parts(global_name: str, shard: torch.Tensor, spec: GPTSpec, tp: int,
                tp_rank: int) -> list[tuple[str, torch.Tensor, tuple | None]]:
    """(hf_name, view, region) for each HF tensor held in TP rank `tp_rank`'s shard of a megatron tensor.

    `view` is the part of `shard` that holds rows/columns `region` = (dim, start, stop) of that HF
    tensor (None: all of it), in the HF element order; 2-D HF tensors keep their last dim, the
    fused parts of a 1-D bias are N-D views. Views, never copies: writing into them fills the shard
    (rows past the true vocabulary are padding no HF tensor covers).
    """
    srcs = hf_sources(global_name, spec)
    if is_vocab_tensor(global_name):
        per = shard.shape[0]
        start = min(tp_rank * per, spec.vocab_size)  # a rank past the vocabulary holds only padding
        rows = min(start + per, spec.vocab_size) - start
        return [(srcs[0], shard[:rows], (0, start, start + rows))]
    dim = tp_split_dim(global_name)
    if dim is None:
        return [(srcs[0], shard, None)]
    if len(srcs) == 3:
        groups, d = spec.num_key_value_heads // tp, spec.kv_channels
        hpg = spec.num_attention_heads // spec.num_key_value_heads
        grouped = shard.view(groups, hpg + 2, d, *shard.shape[1:])
        q_rows, kv_rows = groups * hpg * d, groups * d
        return [(srcs[0], grouped[:, :hpg], (0, tp_rank * q_rows, (tp_rank + 1) * q_rows)),
                (srcs[1], grouped[:, hpg], (0, tp_rank * kv_rows, (tp_rank + 1) * kv_rows)),
                (srcs[2], grouped[:, hpg + 1], (0, tp_rank * kv_rows, (tp_rank + 1) * kv_rows))]
    per = shard.shape[dim] // len(srcs)
    return [(name, shard.narrow(dim, i * per, per), (dim, tp_rank * per, (tp_rank + 1) * per))
            for i, name in enumerate(srcs)]


def _dtype(reader, name):
    return reader.read(name, 0, 0, 1).dtype


def stage_state(reader: TensorReader, spec: GPTSpec, tp: int, pp: int, tp_rank: int, pp_rank: int,
                head: str = "lm", ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """{local megatron name: shard} for one (tp_rank, pp_rank, ep_rank), read lazily from an HF `reader`."""
    return {local: read_shard(glob, reader, spec, tp, tp_rank)
            for local, glob in stage_names(spec, pp, pp_rank, head, ep, ep_rank)}
