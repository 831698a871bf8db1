"""Exact causal attention of a packed THD sequence split over a context-parallel (CP) group.

Layout (megatron's and verl's load-balanced zig-zag, as megatron-core's SelfAttention hands it to core
attention after RoPE): every sequence i of the pack, padded to a multiple of 2·CP, is cut into 2·CP
chunks of c_i = L_i / (2·CP) tokens; CP rank r holds chunks r and 2·CP-1-r (in that order), and the
sequences follow each other, sequence i starting at local offset cu_seqlens_padded[i] // CP.
`zigzag_positions` gives the pack index of every local token.

Exchange: an all-gather of K and V over the CP group, not a ring. Per layer each rank receives
(CP-1)/CP of the pack's K and V, the same bytes as a ring's CP-1 steps, but in one collective before
the attention instead of overlapped with it; with GQA (K and V have groups/heads of Q's size) that is
small next to Q. Memory: each rank keeps the whole pack's K and V (CP x its own) for backward, where a
ring keeps its own and sends them round again in backward. In backward each K/V gradient goes back to
its owner: a reduce-scatter on NCCL ((CP-1)/CP of the pack's K/V bytes again); gloo has none, so an
all-reduce of the whole K/V gradient, of which each rank keeps its slice (about twice the bytes).

Attention: local chunk j attends to keys [0, (j+1)·c) of its own sequence with a bottom-right aligned
causal mask; a square block (CP 1, or rank 0's first chunk) is plain `is_causal`. Memory stays linear
in the sequence length: on CUDA `causal_lower_right` runs flash (native GQA) or memory-efficient
attention (K/V repeated for GQA); where neither applies (CPU) the chunk's queries run in blocks of
`QUERY_BLOCK_ROWS` rows, each with its own mask under activation checkpointing, so a mask exists only
for one block at a time and is rebuilt in backward (the price: each block's forward runs twice).
Must not: call megatron's global state, or attend across sequences of a pack.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

QUERY_BLOCK_ROWS = 512
"""Query rows per masked block where no kernel has a bottom-right causal mask (CPU): the transient mask
is QUERY_BLOCK_ROWS x keys."""


def zigzag_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Pack index [T_local] (long, on cu_seqlens' device) of each token CP rank `cp_rank` holds."""
    cu = cu_seqlens_padded.long()
    lengths = cu[1:] - cu[:-1]
    if bool((lengths % (2 * cp_size)).any()):
        raise ValueError(f"zigzag_positions: every padded length must be a multiple of 2*cp={2 * cp_size}, "
                         f"got {lengths.tolist()}")
    chunk = lengths // (2 * cp_size)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), 2 * chunk)
    local_start = torch.cumsum(2 * chunk, 0) - 2 * chunk
    t = torch.arange(len(seq), device=cu.device) - local_start[seq]  # index within the sequence's local tokens
    c = chunk[seq]
    back = t >= c
    j = torch.where(back, 2 * cp_size - 1 - cp_rank, cp_rank)
    return cu[seq] + j * c + t - back * c


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (now deprecated) to *_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherKV(torch.autograd.Function):
    """[2, T_local, groups, d] of every CP rank -> [2, T, groups, d] in pack order; backward returns each
    rank the sum of all ranks' gradients for its own tokens."""

    @staticmethod
    def forward(ctx, kv, order, group):
        cp = order.shape[0]
        gathered = kv.new_empty((cp * 2,) + tuple(kv.shape[1:]))  # ranks concatenated along dim 0
        _all_gather_single(gathered, kv.contiguous(), group=group)
        gathered = gathered.view((cp,) + tuple(kv.shape))
        whole = kv.new_empty((2, cp * kv.shape[1]) + tuple(kv.shape[2:]))
        for r in range(cp):
            whole.index_copy_(1, order[r], gathered[r])
        ctx.order, ctx.group = order, group
        return whole

    @staticmethod
    def backward(ctx, grad):
        send = torch.stack([grad.index_select(1, idx) for idx in ctx.order])  # [cp, 2, T_local, groups, d]
        if dist.get_backend(ctx.group) == "gloo":  # no reduce_scatter on gloo
            dist.all_reduce(send, group=ctx.group)
            return send[dist.get_rank(ctx.group)], None, None
        out = torch.empty_like(send[0])
        _reduce_scatter_single(out, send.flatten(0, 1), group=ctx.group)
        return out, None, None


def _sdpa(q, k, v, **kwargs):
    """SDPA on [L, n, d] tensors (GQA by `enable_gqa`, K/V not repeated) -> [Lq, heads, d] (a view)."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kwargs)
    return out.squeeze(0).transpose(0, 1)


def _masked_block(q, k, v, scale, dropout_p):
    allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril(k.shape[0] - q.shape[0])
    return _sdpa(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)


def _native_lower_right(q, k, v, dropout_p):
    """(k, v) for which `causal_lower_right` runs a fused CUDA kernel, or None where it would build the mask."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    if not q.is_cuda:
        return None
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if can_use_flash_attention(SDPAParams(qh, kh, vh, None, dropout_p, False, k.shape[1] != q.shape[1])):
        return k, v
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:  # the memory-efficient kernel has no GQA
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if can_use_efficient_attention(SDPAParams(qh, kh, vh, None, dropout_p, False, False)):
        return k, v
    return None


def lower_right_causal(q, k, v, scale: float, dropout_p: float = 0.0) -> list:
    """Query rows [Lq, heads, d] at the last Lq of Lk key positions, each seeing keys up to its own ->
    pieces of the output [Lq, heads, d] in row order (to be concatenated)."""
    if q.shape[0] == k.shape[0]:
        return [_sdpa(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale)]
    native = _native_lower_right(q, k, v, dropout_p)
    if native is not None:
        from torch.nn.attention.bias import causal_lower_right

        return [_sdpa(q, *native, attn_mask=causal_lower_right(q.shape[0], k.shape[0]), dropout_p=dropout_p,
                      scale=scale)]
    block = functools.partial(_masked_block, scale=scale, dropout_p=dropout_p)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    shift, pieces = k.shape[0] - q.shape[0], []
    for start in range(0, q.shape[0], QUERY_BLOCK_ROWS):
        end = min(start + QUERY_BLOCK_ROWS, q.shape[0])
        args = (q[start:end], k[:shift + end], v[:shift + end])
        pieces.append(checkpoint(block, *args, use_reentrant=False) if recompute else block(*args))
    return pieces


def cp_attention(query, key, value, cu_seqlens_padded, cp_group, softmax_scale: float, dropout_p: float = 0.0):
    """Causal attention of this CP rank's tokens of a THD pack over all earlier-or-equal positions of
    their own sequence. query [T_local, heads, d], key/value [T_local, groups, d] (zig-zag layout, see
    the module docstring), cu_seqlens_padded [n+1] global -> [T_local, heads, d]. cp_group None or of
    size 1: plain per-sequence causal attention of the pack."""
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    rank = 0 if cp_group is None else dist.get_rank(cp_group)
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    if query.shape[0] * cp != bounds[-1] or key.shape[0] != query.shape[0] or query.shape[1] % key.shape[1]:
        raise ValueError(f"cp_attention: query {tuple(query.shape)}, key {tuple(key.shape)} do not hold 1/{cp} of a "
                         f"{bounds[-1]}-token pack with heads a multiple of groups")
    if any((b - a) % (2 * cp) for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cp_attention: every padded length must be a multiple of 2*cp={2 * cp}, got cu {bounds}")
    if cp > 1:
        order = torch.stack([zigzag_positions(cu_seqlens_padded.to(key.device), cp, r) for r in range(cp)])
        key, value = _GatherKV.apply(torch.stack((key, value)), order, cp_group)
    elif value.requires_grad and torch.is_grad_enabled():
        value = value.contiguous()  # a view of the fused QKV projection would keep all of it for backward
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = (b - a) // (2 * cp)
        q, k, v = query[a // cp:a // cp + 2 * c], key[a:b], value[a:b]
        if c == 0:
            continue
        if cp == 1:
            pieces += lower_right_causal(q, k, v, softmax_scale, dropout_p)
            continue
        for j, rows in ((rank, q[:c]), (2 * cp - 1 - rank, q[c:])):
            pieces += lower_right_causal(rows, k[:(j + 1) * c], v[:(j + 1) * c], softmax_scale, dropout_p)
    return torch.cat(pieces) if pieces else torch.zeros_like(query)
