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
`QUERY_BLOCK_ROWS` rows, each with its own mask, recomputed in backward, so a mask exists only for one
block at a time (the price: those blocks' forward runs twice). One autograd function runs every piece
and writes each input's gradient into one buffer (slices of the inputs would each get a whole-size zero
gradient from autograd, to be summed: quadratic in the number of sequences of a pack).
Must not: call megatron's global state, or attend across sequences of a pack.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

QUERY_BLOCK_ROWS = 1024
"""Query rows per masked block where no kernel has a bottom-right causal mask (CPU): the transient mask
is QUERY_BLOCK_ROWS x keys (bool, and float inside SDPA). Smaller blocks lower the peak but cost time: each
block's backward also pays for its keys' GQA gradients (16k tokens, 8/2 heads of 64, fp32, CP 2 rank 0's
forward + backward in one thread: 128 rows 97 MiB peak, 12.5 s; 512: 123 MiB, 10.2 s; 1024: 157 MiB, 8.0 s)."""


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
    """key, value [T_local, groups, d] of every CP rank -> [T, groups, d] each, in pack order; backward
    returns each rank the sum of all ranks' gradients for its own tokens."""

    @staticmethod
    def forward(ctx, key, value, order, group):
        cp, local = order.shape
        gathered = key.new_empty((cp * 2, local) + tuple(key.shape[1:]))  # ranks concatenated along dim 0
        _all_gather_single(gathered, torch.stack((key, value)), group=group)
        gathered = gathered.view((cp, 2, local) + tuple(key.shape[1:]))
        whole = [key.new_empty((cp * local,) + tuple(key.shape[1:])) for _ in range(2)]
        for r in range(cp):
            for i in range(2):
                whole[i].index_copy_(0, order[r], gathered[r, i])
        ctx.order, ctx.group = order, group
        return tuple(whole)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        send = torch.stack([torch.stack([g.index_select(0, idx) for g in (grad_key, grad_value)]) for idx in ctx.order])
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(send[0])
            _reduce_scatter_single(out, send.flatten(0, 1), group=ctx.group)
        else:  # gloo has no reduce_scatter
            dist.all_reduce(send, group=ctx.group)
            out = send[dist.get_rank(ctx.group)]
        return out[0], out[1], None, None


def _sdpa(q, k, v, **kwargs):
    """SDPA on [L, n, d] tensors (GQA by `enable_gqa`, K/V not repeated) -> [Lq, heads, d] (a view)."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1], **kwargs)
    return out.squeeze(0).transpose(0, 1)


def _lower_right_kernel(query, key, value, dropout_p: float) -> str:
    """How bottom-right causal pieces of these tensors run: "fused" (`causal_lower_right` reaches flash,
    or memory-efficient attention, on CUDA), "repeat" (memory-efficient once K/V are repeated to every
    head: it has no GQA) or "masked" (CPU: explicit masks in recomputed blocks)."""
    if not query.is_cuda:
        return "masked"
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    q, k, v = (t[:1].transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # one token: shapes and dtypes
    gqa = k.shape[1] != q.shape[1]
    params = SDPAParams(q, k, v, None, dropout_p, False, gqa)
    if can_use_flash_attention(params) or (not gqa and can_use_efficient_attention(params)):
        return "fused"
    if gqa:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        if can_use_efficient_attention(SDPAParams(q, k, v, None, dropout_p, False, False)):
            return "repeat"
    return "masked"


def _piece(q, k, v, scale: float, dropout_p: float):
    """Rows q [Lq, heads, d] at the last Lq of the Lk positions of k, v, each seeing keys up to its own."""
    if q.shape[0] == k.shape[0]:
        return _sdpa(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale)
    if q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        return _sdpa(q, k, v, attn_mask=causal_lower_right(q.shape[0], k.shape[0]), dropout_p=dropout_p, scale=scale)
    allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril(k.shape[0] - q.shape[0])
    return _sdpa(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)


def _plan(bounds: list, cp: int, rank: int, masked: bool) -> list:
    """(q0, q1, k0, k1, recompute) per piece: local query rows [q0, q1) are the last rows of the keys [k0, k1)
    of the pack; recompute: a masked block (its mask is rebuilt in backward instead of kept)."""
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        c = (b - a) // (2 * cp)
        chunks = [(a, b - a, b)] if cp == 1 else [(a // cp, c, a + (rank + 1) * c),
                                                        (a // cp + c, c, a + (2 * cp - rank) * c)]
        for q0, rows, k1 in chunks:
            if rows == 0:
                continue
            if not masked or k1 - a == rows:  # a fused kernel, or a square block: is_causal
                pieces.append((q0, q0 + rows, a, k1, False))
                continue
            for start in range(0, rows, QUERY_BLOCK_ROWS):
                end = min(start + QUERY_BLOCK_ROWS, rows)
                pieces.append((q0 + start, q0 + end, a, k1 - rows + end, True))
    return pieces


class _PackedCausal(torch.autograd.Function):
    """The pieces of a plan over one query [T_local, heads, d] and one key/value [T, groups, d], each
    input's gradient written into one buffer: autograd through slices would give every slice a
    whole-size zero gradient to sum (quadratic in the number of sequences of a pack)."""

    @staticmethod
    def forward(ctx, query, key, value, pieces, scale, dropout_p):
        grad = [ctx.needs_input_grad[i] for i in range(3)]
        out = query.new_empty(query.shape)
        ctx.kept = []
        for q0, q1, k0, k1, recompute in pieces:
            leaves = [t.detach()[i0:i1].requires_grad_(g)
                      for t, (i0, i1), g in zip((query, key, value), ((q0, q1), (k0, k1), (k0, k1)), grad)]
            keep = any(grad) and not recompute
            rng = _rng_state(query.device) if recompute and dropout_p else None
            with torch.set_grad_enabled(keep):
                piece = _piece(*leaves, scale, dropout_p)
            out[q0:q1] = piece.detach()
            if any(grad):
                ctx.kept.append((q0, q1, k0, k1, leaves, piece if keep else None, rng))
        ctx.scale, ctx.dropout_p = scale, dropout_p
        ctx.like = [(t.shape, t.dtype, t.device) for t in (query, key, value)]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        need = [ctx.needs_input_grad[i] for i in range(3)]
        grads = [None, None, None]
        for q0, q1, k0, k1, leaves, piece, rng in ctx.kept:
            if piece is None:
                with torch.enable_grad(), _restored_rng(leaves[0].device, rng):
                    piece = _piece(*leaves, ctx.scale, ctx.dropout_p)
            wanted = [leaf for leaf, n in zip(leaves, need) if n]
            got = iter(torch.autograd.grad(piece, wanted, grad_out[q0:q1]))
            for i, (i0, i1) in enumerate(((q0, q1), (k0, k1), (k0, k1))):
                if not need[i]:
                    continue
                g = next(got)
                shape, dtype, _ = ctx.like[i]
                if grads[i] is None and (i0, i1) == (0, shape[0]):  # one piece covers it: no buffer
                    grads[i] = g
                    continue
                if grads[i] is None:  # like the piece's gradient: the inputs' device and dtype
                    grads[i] = g.new_zeros(shape, dtype=dtype)
                grads[i][i0:i1] += g
        ctx.kept = None
        return grads[0], grads[1], grads[2], None, None, None


def _rng_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _restored_rng(device, state):
    """The generator as it was before a recomputed piece's forward (dropout draws the same mask)."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


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
    if cp > 1 and any((b - a) % (2 * cp) for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cp_attention: every padded length must be a multiple of 2*cp={2 * cp}, got cu {bounds}")
    if cp > 1:
        order = torch.stack([zigzag_positions(cu_seqlens_padded.to(key.device), cp, r) for r in range(cp)])
        key, value = _GatherKV.apply(key, value, order, cp_group)
    elif value.requires_grad and torch.is_grad_enabled():
        value = value.contiguous()  # a view of the fused QKV projection would keep all of it for backward
    kernel = _lower_right_kernel(query, key, value, dropout_p) if cp > 1 else "fused"
    if kernel == "repeat":
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    pieces = _plan(bounds, cp, rank, kernel == "masked")
    if not torch.is_grad_enabled():  # a function's needs_input_grad ignores grad mode: it would keep graphs
        query, key, value = query.detach(), key.detach(), value.detach()
    return _PackedCausal.apply(query, key, value, pieces, softmax_scale, dropout_p)
