"""Generation through megatron-core's own GPTModel forward and `StaticInferenceContext` (the KV cache).

The engine's second decode path (`NativeEngine(decode="megatron")`), kept as the reference the lean
path is measured against. Prompts are left-padded; one prefill, then one token per step. Padded keys
are masked with an explicit mask (True = masked). RoPE in megatron's static inference path indexes
rotary angles by cache slot, not by position id; attention scores depend only on the distance between
query and key, so a left pad shift leaves the results unchanged (position ids are still derived from
the mask and passed). Rows that stop leave the batch and the cache is compacted. Sampling is the
shared `sample_next`, keyed per request, so both paths draw the same tokens from the same logits.
"""
from __future__ import annotations

import torch

from hybridrl.rollout.base import SamplingParams, row_keys, sample_next


def _attention_mask(valid: torch.Tensor, s_in: int) -> torch.Tensor:
    """[B, 1, s_in, Sk] bool, True = masked: causal, padded keys, for the last s_in query slots."""
    sk = valid.shape[1]
    keys = torch.arange(sk, device=valid.device)
    queries = keys[sk - s_in:]
    masked = (keys[None, :] > queries[:, None])[None] | ~valid[:, None, :]
    # a left-pad query would see no key at all; letting it see itself keeps its softmax finite
    masked &= ~(keys[None, :] == queries[:, None])[None]
    return masked[:, None]


def _compact_cache(ctx, keep: torch.Tensor) -> None:
    """Keep only the rows `keep` of every layer's KV cache ([S, B, groups, dim])."""
    for layer, (k, v) in ctx.key_value_memory_dict.items():
        ctx.key_value_memory_dict[layer] = (k.index_select(1, keep), v.index_select(1, keep))
    ctx.max_batch_size = keep.numel()


@torch.no_grad()
def _forward(model, vocab: int, input_ids, valid, ctx, stats) -> torch.Tensor:
    """Next-token logits [B, V] (true vocab, fp32) after feeding input_ids through the cache."""
    s_in = input_ids.shape[1]
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, -s_in:]
    logits = model(input_ids, position_ids, _attention_mask(valid, s_in), inference_context=ctx,
                   runtime_gather_output=True)
    ctx.sequence_len_offset += s_in
    stats["rollout/forward_tokens"] += input_ids.numel()
    return logits[:, -1, :vocab].float()


def generate_static(model, vocab: int, rows: list, sampling: SamplingParams, stops: set, pad_id: int,
                    stats: dict):
    """(tokens, log_probs) per row of rows [(prompt, seed)], as lists, one batch."""
    from megatron.core.inference.contexts import StaticInferenceContext

    device = next(model.parameters()).device
    batch, plen, new = len(rows), max(len(p) for p, _ in rows), sampling.max_new_tokens
    input_ids = torch.full((batch, plen), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(batch, plen + new, dtype=torch.bool, device=device)
    for b, (prompt, _) in enumerate(rows):
        input_ids[b, plen - len(prompt):] = torch.tensor(prompt, device=device)
        valid[b, plen - len(prompt):plen] = True
    keys = row_keys([seed for _, seed in rows], device)
    ctx = StaticInferenceContext(batch, plen + new)
    active = list(range(batch))
    out_tokens, out_logp = [[] for _ in rows], [[] for _ in rows]
    logits = _forward(model, vocab, input_ids, valid[:, :plen], ctx, stats)
    for step in range(new):
        index = torch.full((len(active),), step, dtype=torch.long, device=device)
        tok, logp = sample_next(logits, sampling, keys[active], index)
        keep = []
        for i, (t, lp) in enumerate(zip(tok.tolist(), logp.tolist())):
            out_tokens[active[i]].append(t)
            out_logp[active[i]].append(lp)
            if t not in stops:
                keep.append(i)
        stats["rollout/generated_tokens"] += len(active)
        if step == new - 1 or not keep:
            break
        if len(keep) < len(active):
            idx = torch.tensor(keep, device=device)
            _compact_cache(ctx, idx)
            valid, tok, active = valid[idx], tok[idx], [active[i] for i in keep]
        valid[:, plen + step] = True
        logits = _forward(model, vocab, tok[:, None], valid[:, :plen + step + 1], ctx, stats)
    return out_tokens, out_logp
