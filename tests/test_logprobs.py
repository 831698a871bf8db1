"""Vocab-parallel log-probs and entropy equal a full-vocab float64 reference, values and gradients."""
import pytest
import torch

from dist_helper import run_distributed


from hybridrl.models import logprobs
from hybridrl.models.logprobs import (shifted_log_probs, vocab_parallel_entropy, vocab_parallel_log_probs,
                                         vocab_parallel_sum_pi_squared, vocab_parallel_token_stats)

B, S, V, V_PAD, T = 2, 5, 251, 256, 0.7


def _data():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(B, S, V_PAD, generator=g)
    logits[..., V:] = 50.0  # padding columns must not count, however large
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :2] = torch.tensor([3, 250])  # one label on each TP rank for sure
    w_lp, w_ent = torch.randn(B, S, generator=g), torch.randn(B, S, generator=g)
    return logits, labels, w_lp, w_ent


def _reference(logits, labels, w_lp, w_ent, temperature):
    x = logits.double().requires_grad_()
    logp_all = torch.log_softmax(x[..., :V] / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((w_lp * logp).sum() + (w_ent * ent).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _ours(logits_local, labels, w_lp, w_ent, group, temperature):
    x = logits_local.clone().requires_grad_()
    logp = vocab_parallel_log_probs(x, labels, group, V, temperature)
    ent = vocab_parallel_entropy(x, group, V, temperature)
    ((w_lp * logp).sum() + (w_ent * ent).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _tp2_run(temperature):
    import torch.distributed as dist

    rank = dist.get_rank()
    logits, labels, w_lp, w_ent = _data()
    local = logits.chunk(2, dim=-1)[rank]
    return _ours(local, labels, w_lp, w_ent, dist.group.WORLD, temperature)


@pytest.mark.distributed
def test_tp2_matches_full_vocab_float64_reference():
    logits, labels, w_lp, w_ent = _data()
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, w_lp, w_ent, T)
    outs = run_distributed(_tp2_run, 2, T)
    for lp, ent, _ in outs:
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    grad = torch.cat([g for _, _, g in outs], dim=-1)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=0)
    assert torch.all(grad[..., V:] == 0), "padding columns get no gradient"


@pytest.mark.parametrize("temperature", [1.0, T])
def test_single_rank_matches_reference(temperature):
    logits, labels, w_lp, w_ent = _data()
    ref = _reference(logits, labels, w_lp, w_ent, temperature)
    for got, want in zip(_ours(logits, labels, w_lp, w_ent, None, temperature), ref):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def _fused(logits_local, labels, w_lp, w_ent, group, temperature, chunk):
    logprobs.CHUNK_ELEMENTS = chunk
    x = logits_local.clone().requires_grad_()
    logp, ent = vocab_parallel_token_stats(x[:, 1:], labels[:, 1:], group, V, temperature)
    ((w_lp[:, 1:] * logp).sum() + (w_ent[:, 1:] * ent).sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _tp2_fused(temperature, chunk):
    import torch.distributed as dist

    logits, labels, w_lp, w_ent = _data()
    return _fused(logits.chunk(2, dim=-1)[dist.get_rank()], labels, w_lp, w_ent, dist.group.WORLD, temperature, chunk)


def _fused_reference(temperature):
    logits, labels, w_lp, w_ent = _data()
    w_lp, w_ent = w_lp.clone(), w_ent.clone()
    w_lp[:, 0] = w_ent[:, 0] = 0  # position 0 is outside the scored slice: no gradient there
    lp, ent, grad = _reference(logits, labels, w_lp, w_ent, temperature)
    return lp[:, 1:], ent[:, 1:], grad


# chunks of several rows, of one row, of one position (V_PAD / 2 logits on a TP rank)
@pytest.mark.parametrize("chunk", [1 << 23, (S - 1) * V_PAD, V_PAD // 2])
def test_fused_chunked_stats_match_reference_on_a_slice(chunk, monkeypatch):
    """Log-probs and entropy in one pass over a slice of the positions, processed in chunks, with
    the gradient of both: equal to the reference on one rank and across TP 2."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
    want = _fused_reference(T)
    logits, labels, w_lp, w_ent = _data()
    for got, ref in zip(_fused(logits, labels, w_lp, w_ent, None, T, chunk), want):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)
    outs = run_distributed(_tp2_fused, 2, T, chunk)
    for lp, ent, _ in outs:
        torch.testing.assert_close(lp.double(), want[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), want[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([g for _, _, g in outs], dim=-1).double(), want[2], atol=1e-5, rtol=0)


def test_bf16_logits_give_fp32_results_and_bf16_grads():
    logits, labels, w_lp, w_ent = _data()
    lp, ent, grad = _ours(logits.bfloat16(), labels, w_lp, w_ent, None, 1.0)
    assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == torch.bfloat16
    ref_lp, _, _ = _reference(logits.bfloat16().float(), labels, w_lp, w_ent, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-4, rtol=0)


def test_shift_scores_next_token_from_current_logits():
    logits, _, _, _ = _data()
    ids = torch.randint(0, V, (B, S))
    got = shifted_log_probs(logits, ids, true_vocab_size=V)
    want = torch.log_softmax(logits[:, :-1, :V].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == (B, S - 1)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def _tp2_all_padding_rank():
    import torch.distributed as dist

    logits, labels, w_lp, w_ent = _data()
    labels = labels % 100  # every label on rank 0
    x = logits.chunk(2, dim=-1)[dist.get_rank()].clone().requires_grad_()
    lp, ent = vocab_parallel_token_stats(x, labels, dist.group.WORLD, 100, T)  # rank 1 holds padding only
    ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.distributed
def test_a_rank_holding_only_vocab_padding_adds_nothing():
    """A tiny vocabulary padded for TP leaves a rank without real columns: its share is zero, not NaN."""
    logits, labels, w_lp, w_ent = _data()
    labels = labels % 100
    x = logits[..., :100].double().requires_grad_()
    logp_all = torch.log_softmax(x / T, dim=-1)
    ref_lp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ((w_lp * ref_lp).sum() + (w_ent * ref_ent).sum()).backward()
    outs = run_distributed(_tp2_all_padding_rank, 2)
    for lp, ent, _ in outs:
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[0][2][..., :100].double(), x.grad, atol=1e-5, rtol=0)
    assert torch.all(outs[0][2][..., 100:] == 0) and torch.all(outs[1][2] == 0)


def _sum_pi_squared_reference(logits, vocab, temperature):
    return torch.softmax(logits[..., :vocab].double() / temperature, dim=-1).square().sum(-1)


def _tp2_sum_pi_squared(vocab, temperature, chunk):
    import torch.distributed as dist

    logprobs.CHUNK_ELEMENTS = chunk
    logits, _, _, _ = _data()
    return vocab_parallel_sum_pi_squared(logits.chunk(2, dim=-1)[dist.get_rank()], dist.group.WORLD, vocab, temperature)


@pytest.mark.distributed
@pytest.mark.parametrize("vocab,chunk", [(V, 1 << 23), (V, V_PAD // 2), (100, 1 << 23)])
def test_sum_pi_squared_matches_the_full_softmax_on_one_rank_and_across_tp(vocab, chunk, monkeypatch):
    """sum_v p_v^2 of softmax(logits / T) over the true vocabulary (the padding columns hold large logits that must
    not count; with vocab 100 the second TP rank holds padding only), in chunks of rows or of one position."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
    logits, _, _, _ = _data()
    want = _sum_pi_squared_reference(logits, vocab, T)
    torch.testing.assert_close(vocab_parallel_sum_pi_squared(logits, None, vocab, T).double(), want, atol=1e-6, rtol=1e-5)
    for got in run_distributed(_tp2_sum_pi_squared, 2, vocab, T, chunk):
        assert got.dtype == torch.float32 and got.shape == (B, S)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(want, _sum_pi_squared_reference(logits, vocab, 1.0))  # the temperature is applied
