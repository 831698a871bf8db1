"""Run a GPTModel (actor or critic) over micro-batches at any TP/PP through megatron-core's schedule.

At PP > 1 a stage cannot be called directly (it needs the previous stage's activations), so
every forward, training or not, goes through `get_forward_backward_func`. Every stage receives
the same micro-batches; the per-micro-batch results of `loss_fn` come back on the last stage only.
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridrl.parallel.cpu_compat import cuda_to_cpu, without_cuda_mode


def causal_padding_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """[B, S] (1 = token, 0 = padding) -> megatron's bool [B, 1, S, S] mask, True = masked.

    Masks future keys and padding keys. None stays None (pure causal, megatron's default mask).
    """
    if attention_mask is None:
        return None
    causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=attention_mask.device), 1)
    pad_keys = ~attention_mask.bool()[:, None, None, :]
    return causal[None, None] | pad_keys


def _forward_only_loss(output, micro_batch):
    return output.sum() * 0.0, {"output": output.detach()}


def pipeline_forward(model, micro_batches: list[dict], loss_fn: Callable | None = None,
                     forward_only: bool = True) -> list[dict]:
    """Forward (and backward unless `forward_only`) over `micro_batches`; returns loss_fn's dicts.

    A micro-batch is a dict with "input_ids" [B, S] and optionally "attention_mask" [B, S]
    (1 = token; left or right padding) and "position_ids". Note: megatron's RoPE uses positions
    0..S-1 regardless of position_ids; with left padding this is exact all the same, because RoPE
    attention depends only on relative positions, which a per-row shift does not change.
    `loss_fn(output, micro_batch) -> (scalar loss, dict)`, run on the last stage; output is
    logits [B, S, V_pad/tp] for the actor, values [B, S] for the critic. The default returns
    {"output": output}. Backward: megatron divides each micro-batch loss by their number.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = micro_batches[0]["input_ids"].shape
    if any(mb["input_ids"].shape != (b, s) for mb in micro_batches):
        raise ValueError("all micro-batches must share one [B, S] shape (pipeline p2p buffers are fixed-size)")
    loss_fn = loss_fn or _forward_only_loss

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        pos = mb.get("position_ids")
        pos = torch.arange(s).unsqueeze(0).expand(b, s) if pos is None else pos
        with without_cuda_mode():
            out = chunk(mb["input_ids"], pos, causal_padding_mask(mb.get("attention_mask"), s))
        return out, lambda output: loss_fn(output, mb)

    context = torch.no_grad() if forward_only else torch.enable_grad()
    with context, cuda_to_cpu():
        return list(get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b, forward_only=forward_only))
