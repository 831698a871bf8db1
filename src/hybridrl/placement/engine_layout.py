"""The resharded handoff in the engine's own (megatron) layout: each byte gathered straight into the
engine's parameters where the layouts allow it, digested once at the source and once where it was stored.

A megatron tensor's shard at (tp, rank) covers pieces of the merged tensor (`pieces`: row bands for
column-parallel tensors, two for gate/up, column bands for row-parallel ones; vocabulary padding left
out). The position-weighted fingerprint is linear over pieces placed at their origin
(`fingerprint.weight_fingerprint`), so each training rank digests its own shard once, split by the
rollout ranks' pieces, before the first tensor moves; the sums over the replica (one all-reduce over TP x PP,
started before the first tensor moves: `start_digest_sum`) are what each rollout rank must have stored; its engine digests its parameter where it
holds it. The sender digests all its shards as one `Fingerprints` batch, the engine a bucket's tensors as one
(a few ops per batch, not per tensor).
Nothing is converted to HF names: QKV stays fused, gate/up stays fused; a row-parallel tensor (and a small
gate/up one) is gathered rank-major into one scratch and reordered by the one copy that writes the engine's
parameter; a large gate/up one is gathered by halves, each straight into its half of the parameter. Used by `reshard.update_engine_weights` where `sends_engine_layout` (engines that offer
`layout_targets`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec
from hybridrl.models.hf_checkpoint import sample_weight
from hybridrl.placement.fingerprint import Fingerprints


def _spans(global_name: str, shape: tuple, spec: GPTSpec, tp: int, tp_rank: int) -> list:
    """(first row, last row + 1, origin) of each piece of the merged megatron tensor that TP rank
    `tp_rank`'s shard (of `shape`) holds, origin = (row, col) in merged coordinates (a 1-D tensor is
    one row, split along its columns); vocabulary padding excluded."""
    dim = hc.tp_split_dim(global_name) if tp > 1 else None
    n = shape[0]
    if hc.is_vocab_tensor(global_name):
        start = tp_rank * n
        rows = max(0, min(n, spec.vocab_size - start))
        return [(0, rows, (start, 0))] if rows else []
    if dim is None:
        return [(0, n, (0, 0))]
    if dim == 1:
        return [(0, n, (0, tp_rank * shape[1]))]
    if hc.is_fc1(global_name):  # [gate_r; up_r] -> gate rows and up rows of the merged [gate; up]
        half = n // 2
        return [(0, half, (tp_rank * half, 0)), (half, n, (tp * half + tp_rank * half, 0))]
    return [(0, n, (0, tp_rank * n) if len(shape) == 1 else (tp_rank * n, 0))]


def pieces(global_name: str, shard: torch.Tensor, spec: GPTSpec, tp: int, tp_rank: int) -> list:
    """(view, origin) of each piece of the merged tensor held in `shard` (`_spans`)."""
    return [(shard if (lo, hi) == (0, shard.shape[0]) else shard[lo:hi], origin)
            for lo, hi, origin in _spans(global_name, tuple(shard.shape), spec, tp, tp_rank)]


def _boxes(global_name: str, shape: tuple, spec: GPTSpec, tp: int, tp_rank: int) -> list:
    """(row0, row1, col0, col1) of each piece, in merged coordinates."""
    return [(o[0], o[0] + (1 if len(shape) == 1 else hi - lo), o[1], o[1] + shape[-1])
            for lo, hi, o in _spans(global_name, shape, spec, tp, tp_rank)]


def _box(view: torch.Tensor, origin) -> tuple:
    rows = 1 if view.dim() == 1 else view.shape[0]
    return origin[0], origin[0] + rows, origin[1], origin[1] + view.shape[-1]


def _overlap(view: torch.Tensor, origin, other: tuple):
    """The part of `view` (placed at `origin`) inside the box `other`, with its origin; None if empty."""
    r0, r1, c0, c1 = _box(view, origin)
    lo_r, hi_r, lo_c, hi_c = max(r0, other[0]), min(r1, other[1]), max(c0, other[2]), min(c1, other[3])
    if lo_r >= hi_r or lo_c >= hi_c:
        return None
    if (lo_r, hi_r, lo_c, hi_c) == (r0, r1, c0, c1):  # all of it (every piece at rollout TP 1): no narrowing
        return view, origin
    if view.dim() > 1:
        view = view.narrow(0, lo_r - r0, hi_r - lo_r)
    return view.narrow(-1, lo_c - c0, hi_c - lo_c), (lo_r, lo_c)


def shard_shape(global_name: str, spec: GPTSpec, tp: int) -> tuple:
    full = hc.mcore_full_shape(global_name, spec, tp)
    dim = hc.tp_split_dim(global_name)
    return tuple(n // tp if d == dim else n for d, n in enumerate(full))


def add_source_parts(fp: Fingerprints, key, global_name: str, shard: torch.Tensor, spec: GPTSpec, tp: int,
                     tp_rank: int, rollout_tp: int) -> None:
    """Add into fp, under (key, k), the part of this shard that rollout-TP rank k stores, for every k."""
    shape = shard_shape(global_name, spec, rollout_tp)
    held = pieces(global_name, shard, spec, tp, tp_rank)
    for k in range(rollout_tp):
        fp.touch((key, k))
        boxes = _boxes(global_name, shape, spec, rollout_tp, k)
        for view, origin in held:
            for box in boxes:
                part = _overlap(view, origin, box)
                if part is not None:
                    fp.add((key, k), *part)


def source_digests(global_name: str, shard: torch.Tensor, spec: GPTSpec, tp: int, tp_rank: int,
                   rollout_tp: int) -> torch.Tensor:
    """[rollout_tp] int64: the fingerprint of the part of this shard each rollout-TP rank stores."""
    fp = Fingerprints(shard.device)
    add_source_parts(fp, 0, global_name, shard, spec, tp, tp_rank, rollout_tp)
    return fp.result([(0, k) for k in range(rollout_tp)])


def add_stored_parts(fp: Fingerprints, key, global_name: str, param: torch.Tensor, spec: GPTSpec, tp: int,
                     tp_rank: int) -> None:
    """Add into fp, under `key`, what an engine at (tp, tp_rank) holds of a megatron tensor, read from `param`."""
    fp.touch(key)
    for view, origin in pieces(global_name, param, spec, tp, tp_rank):
        fp.add(key, view, origin)


def stored_digest(global_name: str, param: torch.Tensor, spec: GPTSpec, tp: int, tp_rank: int) -> torch.Tensor:
    """The fingerprint of what an engine at (tp, tp_rank) holds of a megatron tensor, read from `param`."""
    fp = Fingerprints(param.device)
    add_stored_parts(fp, 0, global_name, param, spec, tp, tp_rank)
    return fp.result([0])[0]


def words_align(global_name: str, spec: GPTSpec, tp: int, rollout_tp: int, dtype: torch.dtype) -> bool:
    """Every piece boundary on the last dim falls on a fingerprint word (bf16 pairs pack into 32 bits),
    so sender and receiver read the same words."""
    per_word = max(1, 4 // dtype.itemsize)
    last = hc.mcore_full_shape(global_name, spec)[-1]
    split_last = hc.tp_split_dim(global_name) == 1 or len(hc.mcore_full_shape(global_name, spec)) == 1
    widths = [last] + ([last // tp, last // rollout_tp] if split_last else [])
    return all(w % per_word == 0 for w in widths)


def add_source_digest(fp: Fingerprints, g: str, shard, spec: GPTSpec, groups, rt: int) -> None:
    """Add this rank's share of the sources' digests of `g` for each rollout-TP rank k into (g, k) (nothing where
    it holds no part of it: another stage, or a TP-replicated tensor on TP ranks > 0)."""
    if shard is not None and (groups.tp_rank == 0 or hc.tp_split_dim(g) is not None):
        add_source_parts(fp, g, g, shard, spec, groups.tp, groups.tp_rank, rt)
    else:
        for k in range(rt):
            fp.touch((g, k))


def sends_engine_layout(engine, model, spec: GPTSpec, groups, verify: str) -> bool:
    """The engine takes megatron tensors in its own layout (`layout_targets`, and says the dtype it stores each
    in: `stored_dtype`), on the training tensors' device and dtype, EP 1, with a fingerprint check (or none) whose
    words both ends can read alike."""
    if not all(hasattr(engine, a) for a in ("layout_targets", "stored_dtype")) or verify == "exact" or groups.ep > 1:
        return False
    sample = sample_weight(model)
    rt, _, dtype = engine.shard_layout()
    return (dtype == sample.dtype and getattr(engine, "device", None) == sample.device
            and all(words_align(g, spec, groups.tp, rt, dtype) for g in hc.hf_to_mcore_name_map(spec)))


class Scratch:
    """Reused full-tensor buffers: `scratch` for a gather to reorder (rank-major), `full` for a merged
    tensor the engine takes its slice of (rollout TP > 1 or another vocabulary padding). Bytes, viewed as the
    tensor's dtype (the model's, or fp32 for the local spec's norms in a bf16 model)."""

    def __init__(self, dtype, device):
        self.dtype, self.device, self._bufs = dtype, device, {}

    def scratch(self, shape) -> torch.Tensor:
        return self._get("scratch", shape, self.dtype)

    def full(self, shape, dtype=None) -> torch.Tensor:
        return self._get("full", shape, dtype or self.dtype)

    def _get(self, which: str, shape, dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        buf = self._bufs.get(which)
        if buf is None or buf.numel() < n:
            del buf
            self._bufs.pop(which, None)  # the smaller buffer goes before the larger one comes
            buf = self._bufs[which] = torch.empty(n, dtype=torch.uint8, device=self.device)
        return buf[:n].view(dtype).view(shape)


def raise_first_mismatch(checks: list, spec: GPTSpec, error) -> None:
    """Raise `error` naming the first tensor (in stream order) whose engine-read digest differs from the sum of
    the sources' digests of its slice, for (names, sources' digests, the engine's) per bucket in `checks`: one host
    sync per bucket. On this rank only: `agree_on_failure` then gives the verdict to the replica."""
    for names, sent, theirs in checks:
        bad = (sent != theirs.to(sent.device)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise error(f"engine's stored copy of {names[i]!r} (HF {', '.join(hc.hf_sources(names[i], spec))}) "
                        f"differs from what was sent: fingerprint sent {sent[i].item()}, read back "
                        f"{theirs[i].item()} ({len(bad)} tensors differ in this bucket)", names[i])


def agree_on_failure(error: Exception | None, groups, device, wrap, order: list, spec: GPTSpec) -> None:
    """Every rank of the training replica (TP, PP and, with experts, EP peers: the handoff's collectives span
    them) raises when any of them found a fault: its own error where it found one, else `wrap(message)`, naming
    the tensor where a rank's error names one (`HandoffError.tensor`; the first in `order`, the same list on every
    rank, whichever rank found it). One all-reduce of a flag on `device` (the stream's: nccl wants a GPU) per
    group; a rank that raised alone would leave its peers in the next collective until timeout, and ranks do not
    all store the same tensors (`shares_stage`: a stage reads its own, copies the others')."""
    unnamed, none = len(order), len(order) + 1
    code = none if error is None else {g: i for i, g in enumerate(order)}.get(getattr(error, "tensor", None), unnamed)
    flag = torch.tensor([code], dtype=torch.int64, device=device)
    for group, size in ((groups.tp_group, groups.tp), (groups.pp_group, groups.pp), (groups.ep_group, groups.ep)):
        if size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if error is not None:
        raise error
    code = int(flag.item())
    if code < unnamed:
        name = order[code]
        raise wrap(f"engine's stored copy of {name!r} (HF {', '.join(hc.hf_sources(name, spec))}) differs from what "
                   f"was sent on another rank of the training replica", name)
    if code == unnamed:
        raise wrap("the engine's stored weights differ from what was sent on another rank of the training replica "
                   "(its error names the tensor)")


def start_digest_sum(digests: torch.Tensor, groups):
    """Start summing the sources' digests over the training replica (non-holders gave zeros), in place: one
    all-reduce over TP x PP, started before the first tensor moves and waited for at the first check, so its
    latency and the ranks' skew hide behind the stream. Returns the work to wait on (None: nothing to sum)."""
    group = (groups.mp_group if groups.tp > 1 and groups.pp > 1 else groups.tp_group if groups.tp > 1
             else groups.pp_group if groups.pp > 1 else None)
    return None if group is None else dist.all_reduce(digests, group=group, async_op=True)
