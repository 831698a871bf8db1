"""Vocab-parallel log-probs and entropy equal a full-vocab float64 reference, values and gradients."""
import pytest
import torch

from dist_helper import run_distributed


from hybridrl.models.logprobs import shifted_log_probs, vocab_parallel_entropy, vocab_parallel_log_probs

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
