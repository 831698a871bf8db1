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
"""
from __future__ import annotations

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


def _shift_layer(name: str, delta: int) -> str:
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + delta}.{m.group(2)}" if m else name


def local_to_global(name: str, layer_offset: int) -> str:
    return _shift_layer(name, layer_offset)


def global_to_local(name: str, layer_offset: int) -> str:
    return _shift_layer(name, -layer_offset)


def owner_stage(global_name: str, spec: GPTSpec, pp: int) -> int:
    """The pipeline stage holding a (non-duplicated) megatron tensor."""
    m = _LAYER.match(global_name)
    if m:
        return int(m.group(1)) // (spec.num_layers // pp)
    return 0 if global_name == EMBEDDING else pp - 1


def stage_names(spec: GPTSpec, pp: int, pp_rank: int, head: str = "lm") -> list[tuple[str, str]]:
    """(local, global) megatron names of the weights on stage `pp_rank`; head "lm" or "none" (trunk)."""
    layer_keys = [k for k in _LAYER_MAPS[spec.layer_spec] if spec.qkv_bias or not k.endswith("linear_qkv.bias")]
    rng = layer_range(spec.num_layers, pp, pp_rank)
    names = [(EMBEDDING, EMBEDDING)] if pp_rank == 0 else []
    names += [(f"decoder.layers.{i - rng.start}.{k}", f"decoder.layers.{i}.{k}") for i in rng for k in layer_keys]
    if pp_rank == pp - 1:
        names.append((FINAL_NORM, FINAL_NORM))
        # tied at PP=1: the head reuses the embedding; at PP>1 the last stage keeps its own copy
        if head == "lm" and (not spec.tie_word_embeddings or pp > 1):
            names.append((OUTPUT, OUTPUT))
    return names


def hf_sources(global_name: str, spec: GPTSpec) -> tuple[str, ...]:
    """HF tensor names that make up one megatron tensor (in fused order)."""
    if global_name == OUTPUT and spec.tie_word_embeddings:
        return (HF_EMBEDDING,)
    if global_name in _TOP_MAP:
        return _TOP_MAP[global_name]
    m, layer_map = _LAYER.match(global_name), _LAYER_MAPS[spec.layer_spec]
    if not m or m.group(2) not in layer_map:
        raise KeyError(f"no HF counterpart for megatron tensor {global_name!r} ({spec.layer_spec} layer spec)")
    return tuple(f"model.layers.{m.group(1)}.{s}" for s in layer_map[m.group(2)])


def hf_to_mcore_name_map(spec: GPTSpec, head: str = "lm") -> dict[str, tuple[str, ...]]:
    """Every unique megatron tensor (global names, model order) -> its HF source names."""
    return {g: hf_sources(g, spec) for _, g in stage_names(spec, 1, 0, head)}


def mcore_to_hf_name_map(spec: GPTSpec, head: str = "lm") -> dict[str, tuple[str, int]]:
    """HF name -> (megatron global name, position inside the fused tensor)."""
    return {hf: (g, i) for g, srcs in hf_to_mcore_name_map(spec, head).items() for i, hf in enumerate(srcs)}


def hf_shapes(spec: GPTSpec, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor of a checkpoint with this spec (lm_head omitted when tied)."""
    h, d, i_size = spec.hidden_size, spec.kv_channels, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    per_layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
                 "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                 "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (i_size, h), "mlp.up_proj.weight": (i_size, h),
                 "mlp.down_proj.weight": (h, i_size)}
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


def mcore_full_shape(global_name: str, spec: GPTSpec, tp: int = 1) -> tuple[int, ...]:
    """Shape of a full (TP-merged) megatron tensor; vocab rows padded for `tp`."""
    h, d = spec.hidden_size, spec.kv_channels
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d
    if is_vocab_tensor(global_name):
        return (spec.padded_vocab_size(tp), h)
    suffix = {"linear_qkv.weight": (qkv, h), "linear_qkv.bias": (qkv,),
              "linear_proj.weight": (h, spec.num_attention_heads * d),
              "linear_fc1.weight": (2 * spec.intermediate_size, h),
              "linear_fc2.weight": (h, spec.intermediate_size)}
    for end, shape in suffix.items():
        if global_name.endswith(end):
            return shape
    return (h,)  # the RMSNorm weights


# ---- TP split / merge ------------------------------------------------------------------------------

def tp_split_dim(name: str) -> int | None:
    """Dim a megatron tensor is partitioned along over TP (column-parallel 0, row-parallel 1), None: replicated."""
    if is_vocab_tensor(name) or name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def split_for_tp(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a full megatron-layout tensor (vocab already padded for `tp`)."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of shape {tuple(full.shape)} is not divisible by tp={tp}")
    if name.endswith("linear_fc1.weight"):  # each rank holds [gate_shard; up_shard]
        gate, up = unfuse_gate_up(full)
        return fuse_gate_up(gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank])
    return full.chunk(tp, dim=dim)[tp_rank]


def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_for_tp` over all TP ranks' shards (in rank order)."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
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
                head: str = "lm") -> dict[str, torch.Tensor]:
    """{local megatron name: shard} for one (tp_rank, pp_rank), read lazily from an HF `reader`."""
    return {local: read_shard(glob, reader, spec, tp, tp_rank)
            for local, glob in stage_names(spec, pp, pp_rank, head)}
