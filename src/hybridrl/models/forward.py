"""Run a GPTModel (actor or critic) over micro-batches at any TP/PP through megatron-core's schedule.

At PP > 1 a stage cannot be called directly (it needs the previous stage's activations), so
every forward, training or not, goes through `get_forward_backward_func`. Every stage receives
the same micro-batches; the per-micro-batch results of `loss_fn` come back on the last stage only.
Padding: the local layer spec takes an explicit [B, 1, S, S] mask. The Transformer Engine spec runs
causal attention without a mask, so each row is left-aligned first (its leading pads rotated to the
end, behind the right padding): then causal attention over [real tokens, pads] is exact for every
real token, RoPE positions are the true ones, and the output is rotated back before `loss_fn`.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from hybridrl.models.packing import next_token_labels
from hybridrl.models.routing_replay import replaying
from hybridrl.models.sequence_layout import SequenceLayout
from hybridrl.parallel.cp_tokens import gather_tokens
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


def left_align_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] column index that rotates each row left by its count of leading pads.

    `x.gather(1, index)` left-aligns x; the real tokens of a row must be contiguous (left-padded
    prompt + right-padded response), which is checked.
    """
    b, s = attention_mask.shape
    real = attention_mask.bool()
    leading = (real.long().cumsum(-1) == 0).sum(-1, keepdim=True)
    index = (torch.arange(s, device=real.device) + leading) % s
    aligned = real.gather(1, index)
    if (aligned[:, 1:] & ~aligned[:, :-1]).any():
        raise ValueError("left_align needs each row's real tokens to be contiguous (attention_mask 0..0 1..1 0..0)")
    return index


def restore_alignment(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Inverse of the left-alignment for a [B, S, ...] model output."""
    inverse = torch.empty_like(index).scatter_(1, index, torch.arange(index.shape[1], device=index.device).expand_as(index))
    rows = torch.arange(index.shape[0], device=index.device)[:, None]
    return output[rows, inverse]


def _forward_only_loss(output, micro_batch):
    return output.sum() * 0.0, {"output": output.detach()}


def padding_mode(model) -> str:
    """"mask" for the local layer spec, "left_align" for Transformer Engine (causal-only attention)."""
    while hasattr(model, "module"):
        model = model.module
    return "left_align" if getattr(model, "layer_spec_kind", "local") == "te" else "mask"


@contextlib.contextmanager
def _shapes_sent_ahead(model, micro_batches: list[dict], packed: bool = False):
    """Micro-batches of different [B, S] (trimmed or token-budget ones, packs): megatron's p2p sends each
    activation's shape before it (`variable_seq_lengths`) instead of assuming one fixed shape."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    before = config.variable_seq_lengths
    shapes = {mb["pack_length"] if packed else tuple(mb["input_ids"].shape) for mb in micro_batches}
    config.variable_seq_lengths = before or len(shapes) > 1
    try:
        yield
    finally:
        config.variable_seq_lengths = before


def _padded_tokens(token_fn: Callable, output: torch.Tensor, mb: dict) -> dict:
    """token_fn's per-token results of a padded [B, S] output as [B, S] tensors; with "response_mask" in
    the micro-batch only the positions that predict or value the response are computed (zero before)."""
    ids = mb["input_ids"]
    start = ids.shape[1] - mb["response_mask"].shape[1] - 1 if "response_mask" in mb else 0
    stats = token_fn(output[:, start:], next_token_labels(ids)[:, start:])
    return {k: F.pad(v, (start, 0)) for k, v in stats.items()}


def _pad_columns(mb: dict, multiple: int) -> tuple[dict, int]:
    """Right padding columns up to a multiple of `multiple` (sequence parallelism splits the sequence
    over TP); returns the micro-batch and its original width."""
    s = mb["input_ids"].shape[1]
    extra = -s % multiple
    if not extra:
        return mb, s
    out = dict(mb)
    for key in ("input_ids", "attention_mask", "position_ids", "routed_experts"):
        if out.get(key) is not None:
            v = out[key]
            out[key] = torch.cat([v, v.new_zeros((v.shape[0], extra) + tuple(v.shape[2:]))], 1)
    if out.get("attention_mask") is None:
        out["attention_mask"] = torch.cat([torch.ones_like(mb["input_ids"]), torch.zeros_like(out["input_ids"][:, s:])], 1)
    return out, s


def pipeline_forward(model, micro_batches: list[dict], loss_fn: Callable | None = None,
                     forward_only: bool = True, padding: str | None = None,
                     token_fn: Callable | None = None) -> list[dict]:
    """Forward (and backward unless `forward_only`) over `micro_batches`; returns loss_fn's dicts.

    A micro-batch is a dict with "input_ids" [B, S] and optionally "attention_mask" [B, S]
    (1 = token; left or right padding), "position_ids", and "routed_experts" [B, S, L, k] (the experts
    an MoE model built for routing replay must use); B and S may differ between micro-batches.
    Note: megatron's RoPE uses positions 0..S-1 regardless of position_ids; with left padding this
    is exact all the same, because RoPE attention depends only on relative positions, which a
    per-row shift does not change.
    `loss_fn(output, micro_batch) -> (scalar loss, dict)`, run on the last stage. Without `token_fn`,
    output is the model's: logits [B, S, V_pad/tp] for the actor, values [B, S] for the critic (zero at a
    packed layout's padding). With `token_fn(output, labels) -> {name: per-token tensor}` (labels: each position's
    next token), output is that dict as [B, S] tensors in the rows' columns, whatever the layout: padded,
    packed (`model.remove_padding`, `models/packing.py`) or context parallel (packed, gathered over CP).
    Backward: megatron divides each micro-batch loss by their number.
    `padding`: "mask" or "left_align" (see the module docstring); default from the model's layout.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    loss_fn = loss_fn or _forward_only_loss
    layout = SequenceLayout.of(model)
    padding = padding or padding_mode(model)
    finish = ((lambda output, mb: loss_fn(_padded_tokens(token_fn, output, mb), mb)) if token_fn is not None
              else loss_fn)

    from megatron.core.utils import get_model_config

    moe = bool(getattr(get_model_config(model), "num_moe_experts", None))

    def pads(real):
        """megatron's padding_mask (True: padding) for an MoE model, so its router losses leave the padding out
        whatever the layout; None for a dense model or without a mask."""
        return None if not moe or real is None else real == 0

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        if layout.packed:
            return _packed_step(chunk, mb, layout, token_fn, loss_fn, pads)
        sized, s = _pad_columns(mb, layout.sp)
        ids, mask = sized["input_ids"], sized.get("attention_mask")
        b, width = ids.shape
        routes = sized.get("routed_experts")
        if padding == "left_align" and mask is not None:
            index = left_align_index(mask)
            pos = torch.arange(width, device=ids.device).expand(b, width)
            routes = None if routes is None else routes.gather(1, index[:, :, None, None].expand_as(routes))
            with without_cuda_mode(), replaying(chunk, routes, layout.sp_split):
                out = chunk(ids.gather(1, index), pos, None, **_padding_kw(pads(mask.gather(1, index))))
            return out, lambda output: finish(restore_alignment(output, index)[:, :s], mb)
        pos = sized.get("position_ids")
        pos = torch.arange(width, device=ids.device).expand(b, width) if pos is None else pos
        with without_cuda_mode(), replaying(chunk, routes, layout.sp_split):
            out = chunk(ids, pos, causal_padding_mask(mask, width), **_padding_kw(pads(mask)))
        return out, lambda output: finish(output[:, :s], mb)

    if layout.packed:
        micro_batches = layout.agree_pack_lengths(micro_batches)
        b_max, s_max = 1, max(mb["pack_length"] for mb in micro_batches)
    else:  # with variable shapes these are only the largest; the p2p layer reads each real one
        b_max = max(mb["input_ids"].shape[0] for mb in micro_batches)
        s_max = max(-(-mb["input_ids"].shape[1] // layout.sp) * layout.sp for mb in micro_batches)
    context = torch.no_grad() if forward_only else torch.enable_grad()
    with context, cuda_to_cpu(), _shapes_sent_ahead(model, micro_batches, layout.packed):
        return list(get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches), seq_length=s_max, micro_batch_size=b_max,
            forward_only=forward_only))


def _padding_kw(padding_mask) -> dict:
    return {} if padding_mask is None else {"padding_mask": padding_mask}


def _packed_step(chunk, mb: dict, layout: "SequenceLayout", token_fn: Callable, loss_fn: Callable, pads: Callable):
    """One micro-batch as one packed sequence (this CP rank's part of it); loss_fn gets [B, S] per-token results."""
    ids = mb["input_ids"]
    mask = mb.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    pack = layout.pack(mask, mb.get("pack_length", 0))
    routes = mb.get("routed_experts")
    routes = None if routes is None else pack.pack(routes)
    with without_cuda_mode(), replaying(chunk, routes, layout.sp_split):
        out = chunk(pack.pack(ids), pack.positions(), None, packed_seq_params=pack.params(layout.cp_group),
                    **_padding_kw(pads(pack.pack(mask))))

    def finish(output):
        # without token_fn the model's own output comes back in the rows' columns (under CP gathered whole:
        # for logits that is every rank's vocabulary slice of every token, which per-token results avoid)
        stats = {"output": output} if token_fn is None else token_fn(output, pack.next_token_labels(ids))
        if layout.cp > 1:
            stats = {k: gather_tokens(v, pack.local, layout.cp_group) for k, v in stats.items()}
        tokens = {k: pack.unpack(v) for k, v in stats.items()}
        return loss_fn(tokens["output"] if token_fn is None else tokens, mb)

    return out, finish
