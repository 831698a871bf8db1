"""Log-probs of labels and entropy from TP-sharded logits, without gathering the vocabulary.

Each TP rank holds logits [B, S, V_pad/tp] for its contiguous vocab slice. Per token only scalars
cross the TP group: each rank's max, then its rescaled sum of exps, sum of p*z and the target logit.
Columns at or beyond `true_vocab_size` (megatron's vocab padding) are excluded. Log-probs and
entropy come from one fused function, differentiable w.r.t. the logits (closed-form backward,
fp32), with a sampling temperature. It works through the vocabulary in chunks of at most
`CHUNK_ELEMENTS` logits and keeps only per-token statistics (log-sum-exp, entropy) for backward,
which recomputes the softmax chunk by chunk: no [B, R, V] fp32 tensor is ever whole, only the
gradient (in the logits' dtype) is (`planner.memory.head_activation_bytes` counts this).
Works without a group too (tp_group=None: a single rank holding the whole vocab). `vocab_parallel_sum_pi_squared`
gives sum_v p_v^2 per position the same way (the optimal-token-baseline estimator's path-variance proxy), no gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 23
"""Logits per chunk (32 MiB per fp32 temporary; two are alive at once)."""


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _valid_columns(logits, group, true_vocab_size):
    """A [V_local] mask of real (non-padding) columns, or None when every column is real; the local
    vocab offset."""
    v_local = logits.shape[-1]
    start = _rank(group) * v_local
    vocab = true_vocab_size if true_vocab_size is not None else v_local * _world(group)
    if start + v_local <= vocab:
        return None, start
    return torch.arange(start, start + v_local, device=logits.device) < vocab, start


def _chunks(rows: int, length: int, vocab: int):
    """(row slice, position slice) pairs covering [rows, length] with <= CHUNK_ELEMENTS logits each
    (at least one position)."""
    if length * vocab <= CHUNK_ELEMENTS:
        step = max(1, CHUNK_ELEMENTS // (length * vocab))
        for r0 in range(0, rows, step):
            yield slice(r0, r0 + step), slice(0, length)
        return
    step = max(1, CHUNK_ELEMENTS // vocab)
    for r in range(rows):
        for p0 in range(0, length, step):
            yield slice(r, r + 1), slice(p0, p0 + step)


def _scaled(chunk, valid, temperature):
    """A new fp32 copy of a logits chunk / T, -inf at padding columns."""
    y = chunk.to(torch.float32, copy=True)
    if temperature != 1:
        y.div_(temperature)
    if valid is not None:
        y.masked_fill_(~valid, float("-inf"))
    return y


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., L, V] as [N, L, V] (a view for any slice along L)."""
    return t.reshape(-1, *t.shape[-2:])


class _TokenStats(torch.autograd.Function):
    """(log p(label), entropy) per position of logits [..., L, V_local] / T; labels [..., L] or None."""

    @staticmethod
    def forward(ctx, logits, labels, group, true_vocab_size, temperature, with_entropy):
        ctx.set_materialize_grads(False)
        valid, start = _valid_columns(logits, group, true_vocab_size)
        x = _rows(logits)
        n, length, v = x.shape
        stats = torch.zeros(4, n, length, dtype=torch.float32, device=logits.device)
        m, s, t, z_target = stats  # local max, sum exp(z), sum exp(z) * z, z at the label (z = y - m)
        if labels is not None:
            local = _rows(labels.unsqueeze(-1)).squeeze(-1) - start
            mine = (local >= 0) & (local < v)
            idx = local.clamp(0, v - 1).unsqueeze(-1)
        for rows, pos in _chunks(n, length, v):
            y = _scaled(x[rows, pos], valid, temperature)
            mc = y.amax(dim=-1, keepdim=True)
            mc.masked_fill_(mc == float("-inf"), 0.0)  # a rank whose columns are all padding
            y.sub_(mc)
            m[rows, pos] = mc.squeeze(-1)
            if labels is not None:
                z_target[rows, pos] = y.gather(-1, idx[rows, pos]).squeeze(-1)
            e = torch.exp(y)  # 0 at padding
            s[rows, pos] = e.sum(dim=-1)
            if with_entropy:
                if valid is not None:
                    y.masked_fill_(~valid, 0.0)
                t[rows, pos] = e.mul_(y).sum(dim=-1)
            del y, e
        if labels is not None:
            z_target.copy_(torch.where(mine, z_target, 0.0))  # -inf where the label is another rank's
        if _world(group) > 1:  # rescale every rank's sums to the global max, then add them up
            top = _all_reduce(m.clone(), group, dist.ReduceOp.MAX)
            shift = m - top  # <= 0
            scale = torch.where(s > 0, torch.exp(shift), 0.0)  # 0 for a rank with nothing real
            t.add_(shift * s).mul_(scale)
            s.mul_(scale)
            z_target.add_(shift * mine if labels is not None else 0)
            _all_reduce(stats[1:], group)
            m = top
        log_s = torch.log(s)
        lse = m + log_s  # log-sum-exp of y
        log_probs = z_target - log_s if labels is not None else logits.new_empty(0, dtype=torch.float32)
        entropy = log_s - t / s if with_entropy else logits.new_empty(0, dtype=torch.float32)
        ctx.save_for_backward(logits, lse, entropy if with_entropy else None,
                              idx if labels is not None else None, mine if labels is not None else None)
        ctx.group, ctx.true_vocab_size, ctx.temperature = group, true_vocab_size, temperature
        shape = logits.shape[:-1]
        return log_probs.view(shape) if labels is not None else log_probs, \
            entropy.view(shape) if with_entropy else entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, lse, entropy, idx, mine = ctx.saved_tensors
        if idx is None:
            grad_log_probs = None
        if entropy is None:
            grad_entropy = None
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None
        valid, _ = _valid_columns(logits, ctx.group, ctx.true_vocab_size)
        x, out = _rows(logits), torch.empty_like(logits)
        dx = _rows(out)
        n, length, v = x.shape
        a = _rows(grad_log_probs.unsqueeze(-1)).squeeze(-1) if grad_log_probs is not None else None
        b = _rows(grad_entropy.unsqueeze(-1)).squeeze(-1) if grad_entropy is not None else None
        for rows, pos in _chunks(n, length, v):
            log_p = _scaled(x[rows, pos], valid, ctx.temperature).sub_(lse[rows, pos].unsqueeze(-1))
            p = torch.exp(log_p)  # 0 at padding
            # d logp_t / dy_j = 1[j = t] - p_j;  dH / dy_j = -p_j (log p_j + H)
            if b is not None:
                g = log_p.add_(entropy[rows, pos].unsqueeze(-1))
                if valid is not None:
                    g.masked_fill_(~valid, 0.0)
                g.mul_(b[rows, pos].unsqueeze(-1))
                if a is not None:
                    g.add_(a[rows, pos].unsqueeze(-1))
                g.mul_(p).neg_()
            else:
                g = p.mul_(a[rows, pos].unsqueeze(-1).neg())
            if a is not None:
                g.scatter_add_(-1, idx[rows, pos], (a[rows, pos] * mine[rows, pos]).unsqueeze(-1))
            if ctx.temperature != 1:
                g.div_(ctx.temperature)
            dx[rows, pos] = g
            del log_p, p, g
        return out, None, None, None, None, None


def vocab_parallel_token_stats(logits: torch.Tensor, labels: torch.Tensor | None, tp_group=None,
                               true_vocab_size: int | None = None, temperature: float = 1.0,
                               with_entropy: bool = True):
    """(log softmax(logits / T)[label], entropy of softmax(logits / T)), fp32, shape logits.shape[:-1];
    logits [..., V_local] sharded over TP. Either is None when not asked for (labels None,
    with_entropy False); one pass over the logits gives both."""
    if logits.dim() == 1:
        lp, ent = vocab_parallel_token_stats(logits[None], None if labels is None else labels[None], tp_group,
                                             true_vocab_size, temperature, with_entropy)
        return None if lp is None else lp[0], None if ent is None else ent[0]
    lp, ent = _TokenStats.apply(logits, labels, tp_group, true_vocab_size, temperature, with_entropy)
    return lp if labels is not None else None, ent if with_entropy else None


@torch.no_grad()
def vocab_parallel_sum_pi_squared(logits: torch.Tensor, tp_group=None, true_vocab_size: int | None = None,
                                  temperature: float = 1.0) -> torch.Tensor:
    """sum over the true vocabulary of softmax(logits / T)^2, fp32, shape logits.shape[:-1]; logits [..., V_local]
    sharded over TP. Per position only three scalars cross the group: each rank's max, then its sums of exp(z) and
    exp(2 z) rescaled to the global max. No gradient (an estimator's input, as verl's)."""
    valid, _ = _valid_columns(logits, tp_group, true_vocab_size)
    x = _rows(logits)
    n, length, v = x.shape
    stats = torch.zeros(3, n, length, dtype=torch.float32, device=logits.device)
    m, s, q = stats  # local max, sum exp(z), sum exp(2 z) (z = y - m)
    for rows, pos in _chunks(n, length, v):
        y = _scaled(x[rows, pos], valid, temperature)
        mc = y.amax(dim=-1, keepdim=True)
        mc.masked_fill_(mc == float("-inf"), 0.0)  # a rank whose columns are all padding
        e = torch.exp(y.sub_(mc))  # 0 at padding
        m[rows, pos], s[rows, pos], q[rows, pos] = mc.squeeze(-1), e.sum(dim=-1), e.square_().sum(dim=-1)
        del y, e
    if _world(tp_group) > 1:
        scale = torch.exp(m - _all_reduce(m.clone(), tp_group, dist.ReduceOp.MAX))  # <= 1
        s.mul_(scale)
        q.mul_(scale.square_())
        _all_reduce(stats[1:], tp_group)
    return (q / s.square()).view(logits.shape[:-1])


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                             true_vocab_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[label] in fp32, shape of `labels`; logits [..., V_local] sharded over TP."""
    return vocab_parallel_token_stats(logits, labels, tp_group, true_vocab_size, temperature, False)[0]


def vocab_parallel_entropy(logits: torch.Tensor, tp_group=None, true_vocab_size: int | None = None,
                           temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the true vocabulary, fp32, shape logits.shape[:-1]."""
    return vocab_parallel_token_stats(logits, None, tp_group, true_vocab_size, temperature, True)[1]


def shifted_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, tp_group=None,
                      true_vocab_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """[B, S-1]: entry t is log p(input_ids[:, t+1] | prefix up to t), from the logits at position t."""
    return vocab_parallel_log_probs(logits[:, :-1], input_ids[:, 1:], tp_group, true_vocab_size, temperature)
