"""Core attention over torch's `scaled_dot_product_attention`, in place of megatron's unfused one.

megatron's local layer spec computes attention as `DotProductAttention` does: the [b, heads, s, s]
scores materialised, masked, soft-maxed in fp32 and kept for backward, K and V repeated to every
head. `SDPAttention` takes the same call (`SelfAttention.core_attention`: query [sq, b, heads, d],
key and value [sk, b, groups, d] of this TP rank, megatron's bool mask, True = masked) and returns
the same [sq, b, heads·d], with torch's fused kernels: flash or memory-efficient on CUDA, the
flash kernel on CPU; GQA without repeating K and V. It has no weights (state-dict names unchanged).

The mask: an explicit mask wins (megatron's convention; `attn_mask_type` is then ignored); without
one, causal when the layer is (square only) and no mask otherwise (a KV-cache decode step). A bool
mask becomes one additive mask in the query's dtype, shared by every layer of the forward that
passes the same tensor, so the model keeps one copy for backward instead of one per layer. A query
row with every key masked (a left pad under `causal_padding_mask`) attends to its own key instead:
megatron's -10000 fill spreads it over all keys, a fused kernel would return NaN or 0; either way the
row is padding, and only its own (unused) output differs from the unfused path.
Packed sequences (megatron's THD layout, `packed_seq_params`): query [T, heads, d], key and value
[T, groups, d], one causal attention per sequence of `cu_seqlens_q_padded` (no [T, T] mask: memory stays
linear in the pack's length); under context parallelism the exact exchange of `context_parallel.py`.
Must not: change weights or their names, or accept what megatron's own local attention refuses
(attention bias, sliding windows, softmax offsets).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.nn.functional as F

MEM_EFFICIENT_ALIGNMENT = 16
"""Row stride of the mask on CUDA: torch pads a copy of it in every call (every layer) for the
memory-efficient kernel unless its strides are multiples of 8 (`preprocess_mask`)."""

_shared_mask: tuple = ()
"""(bool mask, its version, dtype, additive mask) of the last conversion, all but the numbers weakly held."""


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """megatron's bool mask [b, 1, sq, sk] (True = masked) -> 0 / -inf in `dtype`; fully masked
    query rows keep their own key (the last sq keys are the queries' own). Reused while the same
    mask tensor, unmodified, comes in again (the layers of one forward)."""
    global _shared_mask
    if _shared_mask:
        source, version, cached_dtype, result = _shared_mask
        cached = result()
        if cached is not None and source() is mask and version == mask._version and cached_dtype == dtype:
            return cached
    sq, sk = mask.shape[-2:]
    own = torch.arange(sk, device=mask.device) == torch.arange(sk - sq, sk, device=mask.device)[:, None]
    masked = mask & ~(mask.all(-1, keepdim=True) & own)
    width = sk
    if mask.is_cuda:
        width = -(-sk // MEM_EFFICIENT_ALIGNMENT) * MEM_EFFICIENT_ALIGNMENT
    out = torch.zeros(*masked.shape[:-1], width, dtype=dtype, device=mask.device)[..., :sk]
    out.masked_fill_(masked, float("-inf"))
    _shared_mask = (weakref.ref(mask), mask._version, dtype, weakref.ref(out))
    return out


class SDPAttention(torch.nn.Module):
    """megatron `CoreAttention` (the builder's keywords, the forward's arguments) over SDPA."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("SDPAttention: sliding windows and softmax offsets are not supported")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # megatron's query-key layer scaling divides the scores by the layer number and multiplies
        # the softmax input back by it: the product is this scale either way
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = pg_collection.cp if pg_collection is not None and config.context_parallel_size > 1 else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("SDPAttention: attention bias needs Transformer Engine")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            raise ValueError("SDPAttention: context parallelism runs on packed sequences (model.use_remove_padding)")
        sq, b, heads, d = query.shape
        causal = False
        mask = None
        if attention_mask is not None:
            mask = additive_mask(attention_mask, query.dtype)
        elif (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and sq > 1:
            if key.shape[0] != sq:
                raise ValueError(f"SDPAttention: a causal mask needs as many keys as queries ({key.shape[0]} vs {sq})")
            causal = True
        if value.requires_grad and torch.is_grad_enabled():
            # V is a view of the fused QKV projection: saved as it is, it would keep all of it for backward
            value = value.contiguous()
        # [s, b, n, d] -> [b, n, s, d] views; the kernels take strided inputs
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        # dropout draws from megatron's model-parallel RNG stream, as DotProductAttention's does
        fork = dropout and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)

    def _packed(self, query, key, value, params):
        """THD: [T, heads, d] query, [T, groups, d] key and value -> [T, heads·d]."""
        from megatron.core import tensor_parallel

        from hybridrl.models.context_parallel import cp_attention

        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention: packed sequences in {params.qkv_format!r} format (only 'thd')")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        dropout = self.dropout_p if self.training else 0.0
        fork = dropout and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            # per sequence (one autograd node for the whole pack), across the CP group when there is one
            out = cp_attention(query, key, value, cu, self.cp_group, self.softmax_scale, dropout)
        return out.reshape(out.shape[0], -1)
