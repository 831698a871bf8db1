"""3D resharding: training TP/PP shards -> full HF-named tensors -> a rollout engine at its own TP.

`iter_hf_weights` walks the megatron tensors in HF order; each is broadcast from its pipeline stage,
gathered over training TP, un-fused to HF names (`hf_convert`) and added to a bucket; buckets are
yielded when the next tensor would overflow them, so at most one bucket plus the working set of one
tensor is alive. `update_engine_weights` streams the buckets into `engine.load_weights`, checks the
engine's per-tensor checksums against the sender's (the verified handoff) and measures the peak
extra memory with `LiveTensorMeter`. `new_rollout_groups` makes the rollout-TP process groups and
`join_requests` pools the prompts of one rollout-TP group.
Every rank of the training model replica must run the stream in lockstep (it is collective). This
module must not know any engine's internals: the engine only sees (hf_name, tensor) pairs.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec
from hybridrl.models.hf_checkpoint import weight_state
from hybridrl.rollout.base import weight_checksum


class HandoffError(RuntimeError):
    """The engine did not receive exactly what was sent."""


# ---- rollout process groups ------------------------------------------------------------------------

@dataclass(frozen=True)
class RolloutGroups:
    """The rollout engine's layout: TP groups of consecutive ranks; DP over the groups."""
    tp: int
    tp_rank: int
    tp_group: object
    dp: int
    dp_rank: int
    solo_group: object
    """This rank alone (the engine's pipeline and context-parallel groups, both of size 1)."""


_GROUP_CACHE: dict[tuple, RolloutGroups] = {}


def new_rollout_groups(rollout_tp: int) -> RolloutGroups:
    """Collective on the world: rollout-TP groups [0..tp-1], [tp..2tp-1], ... (cached per process)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % rollout_tp:
        raise ValueError(f"rollout tensor_model_parallel_size={rollout_tp} does not divide the world "
                         f"size {world}; choose a divisor of {world}")
    key = (id(dist.group.WORLD), rollout_tp)  # a re-initialised world gets new groups
    if key not in _GROUP_CACHE:
        tp_group, _ = dist.new_subgroups(group_size=rollout_tp)
        solo_group, _ = dist.new_subgroups(group_size=1)
        _GROUP_CACHE[key] = RolloutGroups(rollout_tp, rank % rollout_tp, tp_group, world // rollout_tp,
                                          rank // rollout_tp, solo_group)
    return _GROUP_CACHE[key]


def join_requests(prompts: list, seeds: list, groups: RolloutGroups | None):
    """(all prompts, all seeds, (lo, hi)) of the rollout-TP group, which decodes as one batch.

    Ranks of one group may bring different prompts (their training-DP shards), the same ones
    (training TP/PP peers when rollout TP > training TP), or none (peers that receive the result
    by broadcast); each distinct contribution is generated once. [lo, hi) are this rank's prompts.
    """
    if groups is None or groups.tp == 1:
        return prompts, seeds, (0, len(prompts))
    gathered = [None] * groups.tp
    dist.all_gather_object(gathered, ([list(p) for p in prompts], list(seeds)), group=groups.tp_group)
    joint_prompts, joint_seeds, offsets = [], [], {}
    for rank_prompts, rank_seeds in gathered:
        key = (tuple(map(tuple, rank_prompts)), tuple(rank_seeds))
        if key not in offsets:
            offsets[key] = len(joint_prompts)
            joint_prompts += rank_prompts
            joint_seeds += rank_seeds
    mine = gathered[groups.tp_rank]
    lo = offsets[(tuple(map(tuple, mine[0])), tuple(mine[1]))]
    return joint_prompts, joint_seeds, (lo, lo + len(prompts))


# ---- live-memory accounting ------------------------------------------------------------------------

class LiveTensorMeter(TorchDispatchMode):
    """Bytes of tensor storages allocated inside the `with` block and still alive; records the peak.

    Every aten op is seen; an output whose storage is not one of the op's inputs' storages is a new
    allocation (views and in-place ops share an input's storage and are not counted). A storage stops
    counting when it is freed (weakref), so the peak is what the block really held at once.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _track(self, t: torch.Tensor, input_storages: set) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live or key in input_storages or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out


# ---- the weight stream -----------------------------------------------------------------------------

def _full_bytes(global_name: str, spec: GPTSpec, tp: int, dtype: torch.dtype) -> int:
    return torch.Size(hc.mcore_full_shape(global_name, spec, tp)).numel() * dtype.itemsize


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_tp(global_name: str, shard: torch.Tensor, groups) -> torch.Tensor:
    """The TP-merged tensor, with at most two full-size buffers alive (gathered + merged)."""
    if groups.tp == 1 or hc.tp_split_dim(global_name) is None:
        return shard
    shard = shard.contiguous()
    out = shard.new_empty((groups.tp * shard.shape[0],) + tuple(shard.shape[1:]))
    _all_gather_single(out, shard, group=groups.tp_group)
    if global_name.endswith("linear_fc1.weight"):
        # rank r holds [gate_r; up_r]; merged is [gate_0..gate_tp-1; up_0..up_tp-1]. One copy, where
        # hc.merge_tp would allocate gate, up and their concatenation (three buffers at once)
        return out.view(groups.tp, 2, -1, *shard.shape[1:]).transpose(0, 1).reshape(out.shape)
    if hc.tp_split_dim(global_name) == 0:
        return out  # rank-order concatenation along dim 0 is already the merged layout
    return hc.merge_tp(global_name, list(out.chunk(groups.tp)))


def _full_tensor(global_name: str, local: dict, spec: GPTSpec, groups, dtype, device) -> torch.Tensor:
    """Full megatron tensor on every rank: TP-gathered on its owner stage, broadcast over PP."""
    owner = hc.owner_stage(global_name, spec, groups.pp)
    if groups.pp_rank == owner:
        full = _gather_tp(global_name, local[global_name].detach(), groups).contiguous()
    else:
        full = torch.empty(hc.mcore_full_shape(global_name, spec, groups.tp), dtype=dtype, device=device)
    if groups.pp > 1:
        dist.broadcast(full, group=groups.pp_group, group_src=owner)
    return full


def iter_hf_weights(model, spec: GPTSpec, groups, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (hf_name, full tensor), every rank getting all of them; collective over the replica.

    A bucket holds whole megatron tensors (q/k/v or gate/up never straddle two buckets) whose full
    sizes sum to <= bucket_bytes; a tensor larger than that is a bucket of its own. Drop each bucket
    before asking for the next: the generator keeps no other reference. Tensors may be views of the
    training parameters (TP=1 owner stage): consume them before the next optimizer step.
    """
    offset = hc.layer_range(spec.num_layers, groups.pp, groups.pp_rank).start
    local = {hc.local_to_global(k, offset): v for k, v in weight_state(model).items()}
    sample = next(iter(local.values()))
    bucket, held = [], 0
    for global_name in hc.hf_to_mcore_name_map(spec):
        size = _full_bytes(global_name, spec, groups.tp, sample.dtype)
        if bucket and held + size > bucket_bytes:  # flush before gathering: bounds the peak
            yield bucket
            bucket, held = [], 0
        full = _full_tensor(global_name, local, spec, groups, sample.dtype, sample.device)
        bucket.extend(hc.mcore_to_hf(global_name, full, spec))
        del full  # parts that are views keep its storage; qkv parts are copies and free it
        held += size
    if bucket:
        yield bucket


# ---- the verified handoff --------------------------------------------------------------------------

@dataclass(frozen=True)
class HandoffReport:
    num_tensors: int
    num_buckets: int
    total_bytes: int
    """Bytes of all HF tensors sent."""
    bucket_bytes: int
    """The bucket size asked for."""
    max_bucket_bytes: int
    """Largest bucket sent (full megatron sizes; > bucket_bytes only for a single oversized tensor)."""
    largest_tensor_bytes: int
    """Largest full (TP-merged, vocab-padded) megatron tensor."""
    peak_extra_bytes: int
    """Most bytes of new tensor storage alive at once during the handoff (LiveTensorMeter)."""
    peak_cuda_extra_bytes: int
    """Same from the CUDA allocator's peak statistics; 0 without CUDA."""
    seconds: float
    verified: bool
    """Sender and engine checksums were compared (and agreed) for every tensor."""

    @property
    def peak_bound_bytes(self) -> int:
        """What the stream promises: one (largest) bucket plus the working set of the largest tensor."""
        return max(self.bucket_bytes, self.max_bucket_bytes) + self.largest_tensor_bytes

    def metrics(self, prefix: str = "perf/weight_sync") -> dict:
        return {f"{prefix}_s": self.seconds, f"{prefix}_bytes": self.total_bytes,
                f"{prefix}_peak_extra_bytes": self.peak_extra_bytes, f"{prefix}_buckets": self.num_buckets}


def _verify(sent: dict, received: dict) -> None:
    for name, digest in sent.items():
        if name not in received:
            raise HandoffError(f"engine did not report tensor {name!r}: it was sent but not received")
        if received[name] != digest:
            raise HandoffError(f"checksum mismatch for tensor {name!r}: sent {digest}, engine got {received[name]}")


def _bucket_bytes(bucket, spec: GPTSpec, tp: int) -> int:
    """A bucket's size as the stream counts it: the full sizes of the megatron tensors it holds."""
    to_mcore = hc.mcore_to_hf_name_map(spec)
    return sum(_full_bytes(g, spec, tp, bucket[0][1].dtype) for g in {to_mcore[n][0] for n, _ in bucket})


def update_engine_weights(engine, model, spec: GPTSpec, groups, bucket_mb: float = 64,
                          verify: bool = True) -> HandoffReport:
    """Stream the training model into `engine.load_weights` bucket by bucket; verify; measure memory.

    Collective over the training replica (every TP/PP rank calls it). With CUDA it resets the
    allocator's peak statistics to measure the handoff's own peak.
    """
    bucket_bytes = int(bucket_mb * 2**20)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    start, n_tensors, n_buckets, total, max_bucket = time.perf_counter(), 0, 0, 0, 0
    with LiveTensorMeter() as meter:
        for bucket in iter_hf_weights(model, spec, groups, bucket_bytes):
            sent = {name: weight_checksum(t) for name, t in bucket} if verify else {}
            received = engine.load_weights(bucket)
            if verify:
                _verify(sent, received)
            n_tensors, n_buckets = n_tensors + len(bucket), n_buckets + 1
            total += sum(t.nbytes for _, t in bucket)
            max_bucket = max(max_bucket, _bucket_bytes(bucket, spec, groups.tp))
            del bucket, sent, received  # the generator builds the next bucket without this one
    dtype = next(iter(weight_state(model).values())).dtype
    largest = max(_full_bytes(g, spec, groups.tp, dtype) for g in hc.hf_to_mcore_name_map(spec))
    cuda_peak = torch.cuda.max_memory_allocated() - cuda_base if cuda else 0
    return HandoffReport(n_tensors, n_buckets, total, bucket_bytes, max_bucket, largest, meter.peak,
                         cuda_peak, time.perf_counter() - start, verify)
