"""3D resharding: training TP/PP shards -> a rollout engine at its own TP, verified.

Four paths, cheapest first (`update_engine_weights` picks): the engine reads the training tensors
themselves (`engine.share_shards`, same layout and device: identity checked, nothing copied); copies
of this rank's shards (`engine.load_shards`, same TP at PP 1); megatron tensors gathered over TP and
broadcast over PP straight into the engine's own layout (`_send_layout`, engines with
`layout_targets`; `engine_layout.py`: one digest per source shard, one read-back per stored slice);
or HF-named tensors in bounded buckets (`iter_hf_weights` -> `engine.load_weights`: vLLM, the exact
hash, EP > 1), with at most one bucket plus one tensor's working set alive. The engine reads back
digests of what it stored; they must equal the sender's (`HandoffError` otherwise).
Every rank of the training model replica must run the stream in lockstep (it is collective). This
module must not know any engine's internals: the engine sees (hf_name, tensor) pairs, or its own
shards by megatron name when it offers `shard_layout` / `load_shards` / `share_shards` / `layout_targets` (with
`stored_dtype`). Each tensor moves in the dtype the training ranks hold it in (`hf_convert.held_dtype`) and is
stored in the engine's (a Transformer Engine trainer's bf16 norms go into the local spec's fp32 ones).
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator

import torch
import torch.distributed as dist

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec
from hybridrl.models.hf_checkpoint import global_weight_state, sample_weight, weight_state
from hybridrl.placement import engine_layout as el
from hybridrl.placement.fingerprint import FOLD_WORDS, VERIFY_MODES, Fingerprints
from hybridrl.placement.handoff_report import HandoffReport
from hybridrl.placement.readback import (FirstFault, HandoffError, as_stored, check_digests, digests_as_stored,
                                         require_reported, shard_hf_parts, stored_shard_error)
from hybridrl.placement.weight_sharing import (share_all, share_stage, shares_stage, shares_weights, source_tensor,
                                               takes_shards)
from hybridrl.placement.live_memory import LiveTensorMeter  # noqa: F401 (imported from here by callers)
from hybridrl.placement.rollout_groups import RolloutGroups, join_requests, new_rollout_groups  # noqa: F401 (same)


# ---- the weight stream -----------------------------------------------------------------------------

def _full_numel(global_name: str, spec: GPTSpec, tp: int) -> int:
    return torch.Size(hc.mcore_full_shape(global_name, spec, tp)).numel()


def _full_bytes(global_name: str, spec: GPTSpec, tp: int, dtype: torch.dtype) -> int:
    return _full_numel(global_name, spec, tp) * dtype.itemsize


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _is_qkv(global_name: str) -> bool:
    """The fused QKV weight or bias (not TE's `linear_qkv.layer_norm_weight`, which is a norm)."""
    return global_name.endswith(("linear_qkv.weight", "linear_qkv.bias"))


GATE_UP_HALVES_BYTES = 2 * 2**20
"""A gate/up shard of at least this many bytes is gathered as its two halves, each straight into its half of the
merged tensor (two collectives, no reorder copy); a smaller one once, rank-major, then reordered: a gloo call costs
~0.1-0.2 ms here, about what copying 1-2 MiB does (`benchmarks/bench_reshard.py`'s medium model: +3 points of the
collectives alone with halves, its small one none)."""


def _gathers_halves(global_name: str, tp: int, shard_bytes: int) -> bool:
    """A gate/up shard [gate_r; up_r] gathered half by half: each half's rank-order concatenation is one
    contiguous half of the merged [gate_*; up_*]."""
    return tp > 1 and hc.is_fc1(global_name) and shard_bytes >= GATE_UP_HALVES_BYTES


def _reordered(global_name: str, tp: int, shard_bytes: int) -> bool:
    """TP shards gathered rank-major and reordered: row-parallel ones, and gate/up ones not gathered by halves."""
    return tp > 1 and (hc.tp_split_dim(global_name) == 1 or hc.is_fc1(global_name)
                       and not _gathers_halves(global_name, tp, shard_bytes))


class _Staging:
    """The memory one stream reuses: a bucket buffer (the HF tensors of one bucket) and a scratch for
    one full tensor that must be reordered (rank-major TP gather) or unfused (QKV) on its way in."""

    def __init__(self, names, spec: GPTSpec, tp: int, bucket_bytes: int, dtype, device):
        sizes = [_full_numel(g, spec, tp) for g in names]
        self.bucket_elems = min(max(bucket_bytes // dtype.itemsize, max(sizes)), sum(sizes))
        self.scratch_elems = max([n for g, n in zip(names, sizes)
                                  if _is_qkv(g) or _reordered(g, tp, n // tp * dtype.itemsize)], default=0)
        self.dtype, self.device = dtype, device
        self._bucket = self._scratch = None
        self.used = 0

    def take(self, shape) -> torch.Tensor:
        """The next free piece of the bucket buffer, as a tensor of `shape`."""
        if self._bucket is None:
            self._bucket = torch.empty(self.bucket_elems, dtype=self.dtype, device=self.device)
        n = torch.Size(shape).numel()
        piece = self._bucket[self.used:self.used + n].view(shape)
        self.used += n
        return piece

    def scratch(self, shape) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.scratch_elems, dtype=self.dtype, device=self.device)
        return self._scratch[:torch.Size(shape).numel()].view(shape)


READ_BACK_BYTES = 16 * 2**20
"""Without overlap (CPU), the engine reads back what it stored once this many bytes are written and not yet read
(and at each bucket's end): a few MiB still sit in the last-level cache, and small tensors share one digest batch
instead of one each. Reading back each tensor at once made the small bench model's verified handoff ~10% slower
(its 30 tensors, 9.5 MiB: one batch now), the medium one's no faster (`benchmarks/bench_reshard.py`)."""

OVERLAP_ON = ("cuda",)
"""Device types where `_send_layout` reads a tensor back while the next collective moves (`_overlapped`). On CUDA
the collective runs on its own stream; over gloo its worker threads need the cores the digests would take:
on 2 cores, 2 ranks, overlapping made the small bench model's verified handoff ~4 ms (15%) slower than running
the two in turn (`benchmarks/bench_reshard.py`)."""


def _overlapped(collective, *args, while_waiting=None, **kwargs) -> None:
    """Run a collective; with `while_waiting`, start it asynchronously and call that meanwhile."""
    if while_waiting is None:
        collective(*args, **kwargs)
        return
    work = collective(*args, async_op=True, **kwargs)
    while_waiting()
    work.wait()


def _gather_tp(global_name: str, shard: torch.Tensor, groups, staging: _Staging, target,
               while_waiting=None) -> torch.Tensor:
    """The TP-merged tensor: gathered straight into `target(shape)` (gate/up by halves, `_gathers_halves`), or
    rank-major into the scratch and reordered into `target` with one copy; the shard itself when there is nothing
    to gather (`while_waiting` then runs at once, else during the (first) gather)."""
    if groups.tp == 1 or hc.tp_split_dim(global_name) is None:
        if while_waiting is not None:
            while_waiting()
        return shard
    shard = shard.contiguous()
    tp, rest = groups.tp, tuple(shard.shape[1:])
    full_shape = (tp * shard.shape[0],) + rest if hc.tp_split_dim(global_name) == 0 else \
        (shard.shape[0], tp * shard.shape[1])
    if _gathers_halves(global_name, tp, shard.nbytes):  # [gate_r; up_r] -> [gate_*; up_*], half by half
        out = target(full_shape)
        halves, merged = shard.view(2, -1, *rest), out.view(2, -1, *rest)
        _overlapped(_all_gather_single, merged[0], halves[0], group=groups.tp_group, while_waiting=while_waiting)
        _all_gather_single(merged[1], halves[1], group=groups.tp_group)
        return out
    if not _reordered(global_name, tp, shard.nbytes):  # rank order along dim 0 is the merged layout
        out = target(full_shape)
        _overlapped(_all_gather_single, out, shard, group=groups.tp_group, while_waiting=while_waiting)
        return out
    ranks = staging.scratch((tp * shard.shape[0],) + rest)  # gloo wants the concatenated shape
    _overlapped(_all_gather_single, ranks, shard, group=groups.tp_group, while_waiting=while_waiting)
    ranks = ranks.view((tp,) + tuple(shard.shape))
    out = target(full_shape)
    if hc.is_fc1(global_name):  # rank r holds [gate_r; up_r]: merged [gate_*; up_*]
        out.view(2, tp, -1, *rest).copy_(ranks.view(tp, 2, -1, *rest).transpose(0, 1))
    else:  # row-parallel: rank r holds columns [r*c, (r+1)*c)
        out.view(shard.shape[0], tp, shard.shape[1]).copy_(ranks.transpose(0, 1))
    return out


def _hf_parts(global_name: str, local: dict, spec: GPTSpec, groups, staging: _Staging, own: bool = False) -> list:
    """(hf_name, tensor) of one megatron tensor, in the bucket buffer or as views of the parameter; `own`:
    this rank's stage and EP rank hold it, and only they need it (gathered over TP, no PP/EP broadcast)."""
    qkv = _is_qkv(global_name)
    target = staging.scratch if qkv else staging.take
    owner = hc.owner_stage(global_name, spec, groups.pp)
    expert_owner = hc.owner_ep_rank(global_name, spec, groups.ep) if groups.ep > 1 else None
    if groups.pp_rank == owner and expert_owner in (None, groups.ep_rank):
        full = _gather_tp(global_name, source_tensor(local, global_name), groups, staging, target)
    else:  # received: a local spec's fp32 norm (small) beside the bucket, the rest in it
        held, shape = hc.held_dtype(global_name, spec, staging.dtype), hc.mcore_full_shape(global_name, spec, groups.tp)
        full = target(shape) if held == staging.dtype else torch.empty(shape, dtype=held, device=staging.device)
    if expert_owner is not None and groups.pp_rank == owner and not own:  # from the EP rank holding it
        full = full.contiguous()
        dist.broadcast(full, group=groups.ep_group, group_src=expert_owner)
    if groups.pp > 1 and not own:
        dist.broadcast(full, group=groups.pp_group, group_src=owner)
    parts = hc.shard_parts(global_name, full, spec, 1, 0)
    if not qkv:
        return [(name, view) for name, view, _ in parts]
    out = []  # q, k and v leave megatron's per-group interleaving: one copy each into the bucket
    for name, view, _ in parts:
        piece = staging.take(view.shape)
        piece.copy_(view)
        out.append((name, piece.view(-1, *full.shape[1:])))
    return out


def iter_hf_weights(model, spec: GPTSpec, groups, bucket_bytes: int, own: list | None = None) -> Iterator[list]:
    """Buckets of (hf_name, full tensor), every rank getting all of them; collective over the replica
    (and over expert-parallel peers, each expert coming from the rank that holds it). With `own` (megatron
    names, all held by this rank's stage and EP rank): only those, collective over TP only.

    A bucket holds whole megatron tensors (q/k/v or gate/up never straddle two buckets) whose full
    sizes sum to <= bucket_bytes; a tensor larger than that is a bucket of its own. The tensors live
    in one reused bucket buffer (or are views of the training parameters where nothing had to move):
    consume each bucket before asking for the next, and before the next optimizer step.
    """
    local = global_weight_state(model, spec, groups)
    sample = sample_weight(model)
    names = list(hc.hf_to_mcore_name_map(spec)) if own is None else own
    staging = _Staging(names, spec, groups.tp, bucket_bytes, sample.dtype, sample.device)
    bucket, held = [], 0
    for global_name in names:
        size = _full_bytes(global_name, spec, groups.tp, sample.dtype)
        if bucket and held + size > bucket_bytes:
            yield bucket
            bucket, held, staging.used = [], 0, 0
        bucket.extend(_hf_parts(global_name, local, spec, groups, staging, own is not None))
        held += size
    if bucket:
        yield bucket


def iter_shards(model, spec: GPTSpec, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(global megatron name, this rank's shard) at PP 1, grouped by about bucket_bytes; no copies."""
    local = weight_state(model)
    batch, held = [], 0
    for _, global_name in hc.stage_names(spec, 1, 0):
        shard = source_tensor(local, global_name)
        if batch and held + shard.nbytes > bucket_bytes:
            yield batch
            batch, held = [], 0
        batch.append((global_name, shard))
        held += shard.nbytes
    if batch:
        yield batch


# ---- the verified handoff --------------------------------------------------------------------------

def verify_bytes(spec: GPTSpec, tp: int, dtype: torch.dtype, mode: str) -> int:
    """An upper bound of what checking the handoff allocates beside the bucket and the scratch.

    fingerprint: for the tensor with most rows and columns r + c (leading dims flattened) its word sums
    (<= 8 bytes each), their int64 copies and weighted products (16), the position-weight tables
    (`fingerprint._weights`, <= 16 per row and column, grown once per process) and, while one grows, up
    to four int64 temporaries of twice its length (<= 64 per row or column): <= 104 bytes per row and
    column, 128 counted; the pending sums of the batches at both ends (`fingerprint.Fingerprints`, up to
    FOLD_WORDS each before they are weighted: kept 4, concatenated 4, widened 8, weights 8, products 8,
    segment ids 8: 48 bytes per sum) + 4 KiB of scalars; and per HF tensor the sender's and the engine's
    digests, their gathered copies and the comparison (<= 48 bytes). exact: one contiguous copy of a
    slice and one host chunk of <= 2^24 elements.
    """
    if mode == "off":
        return 0
    shapes = [hc.mcore_full_shape(g, spec, tp) for g in hc.hf_to_mcore_name_map(spec)]
    if mode == "exact":
        largest = max(torch.Size(s).numel() for s in shapes) * dtype.itemsize
        return largest + min(largest, 2**24 * dtype.itemsize)
    rows_cols = max(torch.Size(s[:-1]).numel() + s[-1] for s in shapes)
    return 128 * rows_cols + 2 * 48 * FOLD_WORDS + 4096 + 48 * len(hc.mcore_to_hf_name_map(spec))


def _send_buckets(engine, model, spec: GPTSpec, groups, bucket_bytes: int, verify: str) -> tuple:
    n_tensors, n_buckets, total, max_bucket = 0, 0, 0, 0
    to_mcore = hc.mcore_to_hf_name_map(spec)
    fault = FirstFault()
    for bucket in iter_hf_weights(model, spec, groups, bucket_bytes):
        received = engine.load_weights(bucket, verify)
        if verify != "off" and fault.error is None:
            names = [n for n, _ in bucket]
            with fault.noted():
                require_reported(names, received)
                check_digests(names, digests_as_stored(bucket, received, verify), received, verify)
        n_tensors, n_buckets = n_tensors + len(bucket), n_buckets + 1
        total += sum(t.nbytes for _, t in bucket)
        owners = {to_mcore[n][0] for n, _ in bucket}
        max_bucket = max(max_bucket, sum(_full_bytes(g, spec, groups.tp, bucket[0][1].dtype) for g in owners))
        del bucket, received  # the generator refills the buffer for the next bucket
    fault.raise_it()
    return n_tensors, n_buckets, total, max_bucket


def _send_shards(engine, model, spec: GPTSpec, groups, bucket_bytes: int, verify: str) -> tuple:
    n_tensors, n_buckets, total, max_bucket = 0, 0, 0, 0
    for batch in iter_shards(model, spec, bucket_bytes):
        received = engine.load_shards(batch, verify)
        parts = shard_hf_parts(batch, spec, groups.tp, groups.tp_rank)
        error = stored_shard_error(parts, received, verify) if verify != "off" else None
        if error:
            raise HandoffError(error)
        n_tensors, n_buckets = n_tensors + len(parts), n_buckets + 1
        batch_bytes = sum(shard.nbytes for _, shard in batch)
        total, max_bucket = total + batch_bytes, max(max_bucket, batch_bytes)
    return n_tensors, n_buckets, total, max_bucket


def _source_digests(names: list, local: dict, spec: GPTSpec, groups, rt: int, device, stored: dict):
    """[len(names), rt] int64: this rank's share of the sources' digest of each tensor's part that rollout-TP rank k
    stores (`engine_layout.add_source_digest`), its shards digested once, before anything moves, as the engine
    stores them (`stored`: the dtype of each; a Transformer Engine trainer's bf16 norms go into fp32 ones). Up
    front, every stage digests its own shards at the same time; per bucket, a bucket held by one stage would keep
    the others waiting at its check."""
    digests = Fingerprints(device)
    for g in names:
        shard = source_tensor(local, g) if groups.pp_rank == hc.owner_stage(g, spec, groups.pp) else None
        el.add_source_digest(digests, g, None if shard is None else as_stored(shard, stored[g]), spec, groups, rt)
    return digests.result([(g, k) for g in names for k in range(rt)]).view(len(names), rt)


def _send_layout(engine, model, spec: GPTSpec, groups, bucket_bytes: int, verify: str, share: bool = False) -> tuple:
    """Each megatron tensor gathered (TP) and broadcast (PP) in the engine's own layout: straight into its
    parameter where that is the merged tensor (rollout TP 1, same vocabulary padding), else into a reused
    scratch the engine takes its slice of (`engine.take_full`). The sources' digests (each training rank's
    shard, digested once, `_source_digests`) of a bucket's tensors are summed over the replica and compared with
    what the engine reads back from its parameters (`engine.layout_digests`). With `share` (`shares_stage`),
    the engine reads this stage's own tensors themselves (nothing copied or read back for them; still sent to
    the other stages) and stores only what the other stages send."""
    rt, rr, dtype = engine.shard_layout()
    local = global_weight_state(model, spec, groups)
    names = list(hc.hf_to_mcore_name_map(spec))
    verifying = verify != "off"
    stage = {g for g in names if hc.owner_stage(g, spec, groups.pp) == groups.pp_rank} if share else set()
    targets = engine.layout_targets([g for g in names if g not in stage])
    fault = FirstFault()
    if share:  # after layout_targets: it wakes the engine, whose stash a share would drop
        with fault.noted():
            share_stage(engine, stage, local, verifying)
    sample = sample_weight(model)
    scratch = el.Scratch(dtype, sample.device)
    n_tensors, n_buckets, total, max_bucket = 0, 0, 0, 0
    device = scratch.device
    overlap = device.type in OVERLAP_ON
    wire = {g: hc.held_dtype(g, spec, sample.dtype) for g in names}  # how every training rank holds g: how it moves
    sent = _source_digests(names, local, spec, groups, rt, device, {g: engine.stored_dtype(g) for g in names}) \
        if verifying else None
    summing = el.start_digest_sum(sent, groups) if verifying else None  # `sent` becomes the replica's sums
    row = {g: i for i, g in enumerate(names)}
    bucket, stored, held = [], Fingerprints(device), 0
    pending, unread = [], 0  # written, not yet read back (and their bytes): on CUDA the engine reads a tensor back
    # while the next one moves
    checks = []  # (names, the sources' digests, the engine's) per bucket

    def read_back():
        nonlocal unread
        if verifying and pending:
            engine.layout_digests(pending, stored)
        pending.clear()
        unread = 0

    def flush():
        nonlocal summing
        read_back()
        if verifying:
            if summing is not None:
                summing, _ = None, summing.wait()
            summed = sent[[row[g] for g in bucket]]
            kept = [i for i, g in enumerate(bucket) if g not in stage]  # what this engine stored
            mine = [bucket[i] for i in kept]
            with fault.noted():
                require_reported(mine, stored)
                if kept:
                    checks.append((mine, summed[kept, rr], stored.result(mine)))  # compared at the end, agreed
        return 1, max(max_bucket, held)

    for g in names:
        size = _full_bytes(g, spec, groups.tp, dtype)
        if bucket and held + size > bucket_bytes:
            n_new, max_bucket = flush()
            n_buckets, bucket, held, stored = n_buckets + n_new, [], 0, Fingerprints(device)
        param, full_shape = targets.get(g), hc.mcore_full_shape(g, spec, groups.tp)
        direct = (param is not None and rt == 1 and tuple(param.shape) == tuple(full_shape) and param.is_contiguous()
                  and param.dtype == wire[g])
        into = (lambda shape, p=param: p) if direct else functools.partial(scratch.full, dtype=wire[g])
        owner = hc.owner_stage(g, spec, groups.pp)
        shard = source_tensor(local, g) if groups.pp_rank == owner else None
        meanwhile = read_back if overlap else None  # touches nothing the collective writes
        if stage:  # rollout TP = TP: a stage's TP shard is what the engine of the same TP rank holds, sent as it is
            moved = shard.contiguous() if shard is not None else param if param.dtype == wire[g] else \
                scratch.full(tuple(param.shape), dtype=wire[g])  # into the engine's own dtype after it arrives
            _overlapped(dist.broadcast, moved, group=groups.pp_group, group_src=owner, while_waiting=meanwhile)
            if shard is None and moved is not param:
                param.copy_(moved)
        else:
            full = _gather_tp(g, shard, groups, scratch, into, meanwhile if groups.tp > 1 else None) \
                if shard is not None else into(full_shape)
            if groups.pp > 1:
                full = full.contiguous()
                _overlapped(dist.broadcast, full, group=groups.pp_group, group_src=owner,
                            while_waiting=meanwhile if groups.tp == 1 or shard is None else None)
            elif groups.tp == 1 and overlap:
                meanwhile()
        bucket.append(g)
        held += size
        n_tensors += len(hc.hf_sources(g, spec))
        if g in stage:  # the engine reads the training tensor itself
            continue
        if not stage:  # (with a stage shared, the broadcast wrote the parameter itself)
            if not direct:
                engine.take_full(g, full)
            elif full is not param:  # nothing to gather (TP 1 or replicated): the shard itself
                param.copy_(full)
            if direct and hc.is_vocab_tensor(g):
                param[spec.vocab_size:].zero_()  # the engine keeps padding rows at zero
        pending.append(g)
        unread += param.nbytes
        if not overlap and unread >= READ_BACK_BYTES:
            read_back()  # while most of what was written is still in the cache
        total += param.nbytes
    if bucket:
        n_new, max_bucket = flush()
        n_buckets += n_new
    with fault.noted():
        el.raise_first_mismatch(checks, spec, HandoffError)
    fault.raise_it()
    return n_tensors, n_buckets, total, max_bucket


def update_engine_weights(engine, model, spec: GPTSpec, groups, bucket_mb: float = 64,
                          verify: str = "fingerprint", measure_memory: bool = False,
                          share: bool = True) -> HandoffReport:
    """Stream the training model into the engine; check what it stored against what was sent.

    Where the engine can read this rank's training tensors themselves (`shares_weights`, and `share`),
    it does: nothing is copied and the check is one of identity (`weight_sharing.share_all`), not of bytes.
    Else, where the engine takes this rank's shards as they are (`takes_shards`), they are copied straight
    into its parameters (no gather, no bucket); else, where `engine_layout.sends_engine_layout`, megatron
    tensors go into the engine's own layout (`_send_layout`; at PP > 1, with `share`, the engine reads this
    stage's own tensors themselves, `shares_stage`, and copies only the other stages'); otherwise buckets of
    HF tensors go to `engine.load_weights`. Either way the engine returns digests read back from its own parameters,
    compared with the sender's digests of the same slices (`verify`: fingerprint, exact or off). A fault found
    on any rank fails the handoff on every rank of the replica (`engine_layout.agree_on_failure`, after the
    stream's last collective), the finder naming the tensor.
    Collective over the training replica (every TP/PP rank calls it). `measure_memory` meters the
    peak of new allocations (`LiveTensorMeter`, slow: for tests and benchmarks) and, with CUDA, takes
    the allocator's peak statistics, which it resets: a caller's peak of its enclosing stage (the
    trainer's `update_weights`) would lose what came before. The time spans the device's work (synchronised).
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}; use one of {VERIFY_MODES}")
    bucket_bytes = int(bucket_mb * 2**20)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()  # work queued before is not the handoff's
    if cuda and measure_memory:
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    shared = share and shares_weights(engine, model, groups)
    direct = shared or takes_shards(engine, model, groups)
    layout = not direct and el.sends_engine_layout(engine, model, spec, groups, verify)
    stage_shared = layout and share and shares_stage(engine, model, groups)
    send = share_all if shared else _send_shards if direct else _send_layout if layout else _send_buckets
    if stage_shared:
        send = functools.partial(_send_layout, share=True)
    start, fault = time.perf_counter(), None
    with LiveTensorMeter() if measure_memory else contextlib.nullcontext() as meter:
        try:
            n_tensors, n_buckets, total, max_bucket = send(engine, model, spec, groups, bucket_bytes, verify)
        except HandoffError as e:  # every path raises at its end, after its last collective
            fault = e
    if verify != "off":
        el.agree_on_failure(fault, groups, sample_weight(model).device, HandoffError,
                            list(hc.hf_to_mcore_name_map(spec)), spec)
    elif fault is not None:
        raise fault
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    dtype = sample_weight(model).dtype
    largest = max(_full_bytes(g, spec, groups.tp, dtype) for g in hc.hf_to_mcore_name_map(spec))
    cuda_peak = torch.cuda.max_memory_allocated() - cuda_base if cuda and measure_memory else 0
    shown = "identity" if shared and verify != "off" else verify
    return HandoffReport(n_tensors, n_buckets, total, bucket_bytes, max_bucket, largest,
                         meter.peak if measure_memory else None, cuda_peak, seconds, shown, direct,
                         0 if shared else verify_bytes(spec, groups.tp, dtype, verify), shared, layout,
                         stage_shared)
