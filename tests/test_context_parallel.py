"""Context-parallel attention (models/context_parallel.py) against per-sequence causal SDPA on whole sequences."""
import pytest
import torch
import torch.nn.functional as F

from dist_helper import run_distributed
from hybridrl.models import context_parallel
from hybridrl.models.context_parallel import cp_attention, zigzag_positions
from hybridrl.placement.reshard import LiveTensorMeter

SCALE = 0.3


def _pack(real_lengths, cp, heads, groups, d=8, seed=0):
    """Random q, k, v [T, n, d] of a pack whose sequences are padded to multiples of 2·cp, the loss weights
    (zero at padding), cu_seqlens_padded and the pack index of every real token."""
    g = torch.Generator().manual_seed(seed)
    padded = [-(-n // (2 * cp)) * 2 * cp for n in real_lengths]
    cu = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, n, d, generator=g) for n in (heads, groups, groups))
    real = torch.cat([torch.arange(n) + int(a) for n, a in zip(real_lengths, cu[:-1])])
    weight = torch.zeros(total, heads, d)
    weight[real] = torch.randn(len(real), heads, d, generator=g)
    return q, k, v, weight, cu, real


def _reference(q, k, v, weight, cu, real_lengths):
    """Output and grads of q, k, v of SDPA is_causal on each sequence's real tokens only."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    outs = []
    for a, n in zip(cu[:-1].tolist(), real_lengths):
        qs, ks, vs = (t[a:a + n].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE,
                                                   enable_gqa=True).transpose(0, 1))
    real = torch.cat([torch.arange(n) + a for n, a in zip(real_lengths, cu[:-1].tolist())])
    out = torch.zeros_like(q).index_put((real,), torch.cat(outs))
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _local_run(q, k, v, weight, cu, group, cp, rank):
    """This rank's slice through cp_attention; output and grads scattered back to pack order (zeros elsewhere)."""
    pos = zigzag_positions(cu, cp, rank)
    ql, kl, vl = (t[pos].clone().requires_grad_() for t in (q, k, v))
    out = cp_attention(ql, kl, vl, cu, group, SCALE)
    (out * weight[pos]).sum().backward()
    whole = [torch.zeros_like(t) for t in (q, q, k, v)]
    for dst, src in zip(whole, (out.detach(), ql.grad, kl.grad, vl.grad)):
        dst[pos] = src
    return whole


CASES = [  # (real lengths, heads, groups, query block rows)
    ([37, 3, 64, 1, 20], 4, 2, 8),    # GQA; sequences of 3 and 1 real tokens (< 2·cp), blocks of 8 rows
    ([50, 12], 2, 2, 512),            # no GQA, one block per chunk
    ([5, 33, 16], 6, 1, 3),           # MQA, blocks that do not divide the chunks
]


def _cp2_cases():
    import torch.distributed as dist

    rank = dist.get_rank()
    results = []
    for lengths, heads, groups, rows in CASES:
        context_parallel.QUERY_BLOCK_ROWS = rows
        q, k, v, weight, cu, _ = _pack(lengths, 2, heads, groups)
        results.append(_local_run(q, k, v, weight, cu, dist.group.WORLD, 2, rank))
    return results


@pytest.mark.distributed
def test_cp2_matches_per_sequence_causal_attention():
    per_rank = run_distributed(_cp2_cases, 2)
    for case, (lengths, heads, groups, _) in enumerate(CASES):
        q, k, v, weight, cu, real = _pack(lengths, 2, heads, groups)
        expected = _reference(q, k, v, weight, cu, lengths)
        got = [per_rank[0][case][i] + per_rank[1][case][i] for i in range(4)]  # disjoint positions
        for name, e, g in zip(("out", "dq", "dk", "dv"), expected, got):
            torch.testing.assert_close(g[real], e[real], atol=1e-5, rtol=1e-5, msg=f"case {case} {name}")
            if name != "out":  # padding sees no loss: no gradient reaches it (every case has padding)
                pad = torch.ones(len(g), dtype=torch.bool)
                pad[real] = False
                assert g[pad].abs().max().item() == 0, f"case {case} {name} at padding"


def test_zigzag_positions_by_hand():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert zigzag_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert zigzag_positions(cu, 1, 0).tolist() == list(range(12))
    with pytest.raises(ValueError, match="multiple of 2"):
        zigzag_positions(torch.tensor([0, 6]), 2, 0)


@pytest.mark.parametrize("heads,groups", [(4, 2), (3, 3)])
def test_cp1_is_per_sequence_causal_attention(heads, groups):
    lengths = [7, 1, 30]
    q, k, v, weight, cu, real = _pack(lengths, 1, heads, groups)
    expected = _reference(q, k, v, weight, cu, lengths)
    got = _local_run(q, k, v, weight, cu, None, 1, 0)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g[real], e[real], atol=1e-5, rtol=1e-5)


def test_cp2_rank_pieces_are_exact_and_keep_no_mask(monkeypatch):
    """Both CP 2 ranks' pieces on K/V gathered by hand (no collective): the CPU path's masked blocks are
    exact in output and gradients, and nothing of the size of a chunk's mask is kept for backward."""
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK_ROWS", 16)
    lengths = [512, 9, 100]
    q, k, v, weight, cu, real = _pack(lengths, 2, 4, 2)
    expected = _reference(q, k, v, weight, cu, lengths)
    got = [torch.zeros_like(t) for t in (q, q, k, v)]
    kl, vl = k.clone().requires_grad_(), v.clone().requires_grad_()
    for rank in range(2):
        pos = zigzag_positions(cu, 2, rank)
        ql = q[pos].clone().requires_grad_()
        with LiveTensorMeter() as meter:
            out = context_parallel._PackedCausal.apply(ql, kl, vl, context_parallel._plan(cu.tolist(), 2, rank, True),
                                                       SCALE, 0.0)
        # kept for backward: the output and the square pieces' own; a chunk's mask alone is 128 x 512 floats
        assert meter.current <= 3 * out.numel() * 4 < 128 * 512 * 4, meter.current
        (out * weight[pos]).sum().backward()
        got[0][pos], got[1][pos] = out.detach(), ql.grad
    got[2], got[3] = kl.grad, vl.grad
    for e, g in zip(expected, got):
        torch.testing.assert_close(g[real], e[real], atol=1e-5, rtol=1e-5)


def test_recomputed_blocks_draw_the_same_dropout(monkeypatch):
    """With dropout the output is M @ v for one random M; a backward that redrew M would break
    sum(out * w) == sum(v * dv)."""
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK_ROWS", 8)
    q, k, v, weight, cu, _ = _pack([64], 2, 2, 1)
    v.requires_grad_()
    torch.manual_seed(0)
    out = context_parallel._PackedCausal.apply(q[zigzag_positions(cu, 2, 1)], k, v,
                                               context_parallel._plan(cu.tolist(), 2, 1, True), SCALE, 0.5)
    loss = (out * weight[:32]).sum()
    loss.backward()
    torch.testing.assert_close((v * v.grad).sum(), loss.detach(), atol=1e-4, rtol=1e-5)
