"""Log-probs of labels and entropy from TP-sharded logits, without gathering the vocabulary.

Each TP rank holds logits [B, S, V_pad/tp] for its contiguous vocab slice. Per token only scalars
cross the TP group: the max, the sum of exps, the target logit (and for entropy the sum of p*z).
Columns at or beyond `true_vocab_size` (megatron's vocab padding) are excluded. Both functions
are differentiable w.r.t. the logits (closed-form backward, fp32) and take a sampling temperature.
Works without a group too (tp_group=None: a single rank holding the whole vocab).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scaled_and_valid(logits, group, true_vocab_size, temperature):
    """fp32 logits / T and a [V_local] mask of real (non-padding) columns; the local vocab offset."""
    v_local = logits.shape[-1]
    start = _rank(group) * v_local
    vocab = true_vocab_size if true_vocab_size is not None else v_local * _world(group)
    valid = torch.arange(start, start + v_local, device=logits.device) < vocab
    return logits.float() / temperature, valid, start


def _softmax_parts(x, valid, group):
    """z = x - global max (0 at padding), exp(z) (0 at padding), global sum of exp(z)."""
    x = x.masked_fill(~valid, float("-inf"))
    m = x.max(dim=-1, keepdim=True).values
    _all_reduce(m, group, dist.ReduceOp.MAX)
    z = (x - m).masked_fill(~valid, 0.0)
    e = torch.exp(z).masked_fill(~valid, 0.0)
    s = _all_reduce(e.sum(dim=-1, keepdim=True), group)
    return z, e, s


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, true_vocab_size, temperature):
        x, valid, start = _scaled_and_valid(logits, group, true_vocab_size, temperature)
        z, e, s = _softmax_parts(x, valid, group)
        local = labels - start
        mine = (local >= 0) & (local < x.shape[-1])
        idx = local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)
        z_target = torch.where(mine, z.gather(-1, idx).squeeze(-1), torch.zeros_like(s.squeeze(-1)))
        _all_reduce(z_target, group)
        ctx.save_for_backward(e / s, idx, mine)
        ctx.temperature, ctx.in_dtype = temperature, logits.dtype
        return z_target - torch.log(s.squeeze(-1))

    @staticmethod
    def backward(ctx, grad):
        p, idx, mine = ctx.saved_tensors
        # d logp_t / d x_j = 1[j = t] - p_j; the one-hot only on the rank owning the label
        g = -p
        g.scatter_add_(-1, idx, mine.unsqueeze(-1).to(g.dtype))
        g = g * (grad.unsqueeze(-1) / ctx.temperature)
        return g.to(ctx.in_dtype), None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group, true_vocab_size, temperature):
        x, valid, _ = _scaled_and_valid(logits, group, true_vocab_size, temperature)
        z, e, s = _softmax_parts(x, valid, group)
        p = e / s
        pz = _all_reduce((p * z).sum(dim=-1, keepdim=True), group)
        ctx.save_for_backward(p, z, pz)
        ctx.temperature, ctx.in_dtype = temperature, logits.dtype
        return (torch.log(s) - pz).squeeze(-1)  # H = log sum exp z - E_p[z]

    @staticmethod
    def backward(ctx, grad):
        p, z, pz = ctx.saved_tensors
        g = -p * (z - pz) * (grad.unsqueeze(-1) / ctx.temperature)  # dH/dx_j = -p_j (z_j - E_p[z])
        return g.to(ctx.in_dtype), None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                             true_vocab_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[label] in fp32, shape of `labels`; logits [..., V_local] sharded over TP."""
    return _VocabParallelLogProb.apply(logits, labels, tp_group, true_vocab_size, temperature)


def vocab_parallel_entropy(logits: torch.Tensor, tp_group=None, true_vocab_size: int | None = None,
                           temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the true vocabulary, fp32, shape logits.shape[:-1]."""
    return _VocabParallelEntropy.apply(logits, tp_group, true_vocab_size, temperature)


def shifted_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, tp_group=None,
                      true_vocab_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """[B, S-1]: entry t is log p(input_ids[:, t+1] | prefix up to t), from the logits at position t."""
    return vocab_parallel_log_probs(logits[:, :-1], input_ids[:, 1:], tp_group, true_vocab_size, temperature)
