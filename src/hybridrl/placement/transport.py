"""Weights from the trainer ranks to rollout ranks of their own (split placement), verified.

The trainers' DP-0 replica walks the same bucket stream as the colocated HF path (`iter_hf_weights`:
TP-gathered, PP-broadcast, HF-named, bounded buckets); global rank 0 broadcasts each bucket's bytes,
packed into one reused buffer, over a `Bridge` to every rollout rank. The bucket plan (names, shapes,
dtype of every bucket: `bucket_plan`, fixed by the model and the bucket size) goes once, on the first
sync; each sync then sends only bytes, and one message at its end with the version and the sender's
digest of every tensor. Each rollout rank digests the bytes it received (checked against the sender's
at the end: the transport), loads each bucket into its engine, and checks what the engine read back
from its own parameters against the received slice (the store). One verdict per sync returns to the
trainers, so a bad handoff stops every rank with the same HandoffError. No rank holds more than one
bucket beyond its own parameters. `perf/weight_sync_bytes` is the bytes broadcast per sync: every HF
tensor once (sum of numel x element size).

Placement must not import engines or the trainer: the engine is any object with `load_weights`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridrl.models.gpt import GPTSpec
from hybridrl.placement.fingerprint import hf_region, weight_digest
from hybridrl.models import hf_convert as hc
from hybridrl.placement.reshard import HandoffError, iter_hf_weights

SENDER = 0
"""Global rank that sends: DP 0, TP 0, PP 0 of the trainers (iter_hf_weights gives it every tensor)."""

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class _Buffer:
    """One flat buffer reused for every bucket, grown when a bucket needs more."""

    def __init__(self):
        self.t = None

    def get(self, numel: int, dtype, device) -> torch.Tensor:
        if self.t is None or self.t.numel() < numel or self.t.dtype != dtype or self.t.device != device:
            self.t = torch.empty(numel, dtype=dtype, device=device)
        return self.t[:numel]


def bucket_plan(spec: GPTSpec, bucket_bytes: int, tp: int, dtype: torch.dtype) -> list:
    """[[(hf_name, shape), ...] per bucket]: the buckets `iter_hf_weights` yields, without any data
    (whole megatron tensors whose full sizes at training TP sum to <= bucket_bytes, one if larger)."""
    shapes, plan, bucket, held = hc.hf_shapes(spec), [], [], 0
    for global_name in hc.hf_to_mcore_name_map(spec):
        size = torch.Size(hc.mcore_full_shape(global_name, spec, tp)).numel() * dtype.itemsize
        if bucket and held + size > bucket_bytes:
            plan.append(bucket)
            bucket, held = [], 0
        bucket += [(hf, tuple(shapes[hf])) for hf in hc.hf_sources(global_name, spec)]
        held += size
    return plan + ([bucket] if bucket else [])


class WeightSender:
    """Trainer side: every rank of the DP-0 replica calls `send` (the bucket stream is collective over
    it, and over its expert-parallel peers, DP ranks 1..ep-1, which walk it too); other DP ranks call it
    too and return at once. `bridge` is None except on the sender."""

    def __init__(self, bridge, groups, spec: GPTSpec, bucket_mb: float, verify: str):
        self.bridge, self.groups, self.spec = bridge, groups, spec
        self.bucket_bytes, self.verify = int(bucket_mb * 2 ** 20), verify
        self.buffer = _Buffer()
        self.plan = None
        """The bucket plan once sent (first sync): later syncs send bytes only."""

    def send(self, model, version: int) -> dict:
        start, sent, buckets, digests = time.perf_counter(), 0, 0, []
        if self.groups.dp_rank < self.groups.ep:  # DP 0 and its expert-parallel peers (which hold the other experts)
            for bucket in iter_hf_weights(model, self.spec, self.groups, self.bucket_bytes):
                if self.bridge is not None:
                    sent += self._send_bucket(buckets, bucket, digests)
                buckets += 1
        verdict = [None]
        if self.bridge is not None:
            self.bridge.broadcast_object({"version": version, "digests": digests if self.verify != "off" else None},
                                         SENDER)
            verdict = [self.bridge.broadcast_object(None, self.bridge.members[1])]
        dist.broadcast_object_list(verdict, src=0)  # every trainer rank raises the same error
        if verdict[0]:
            raise HandoffError(verdict[0])
        return {"perf/weight_sync_s": time.perf_counter() - start, "perf/weight_sync_bytes": float(sent),
                "perf/weight_sync_buckets": float(buckets)}

    def _send_bucket(self, index: int, bucket, digests: list) -> int:
        if self.plan is None:  # first sync: the plan, once, before any bytes
            self.plan = bucket_plan(self.spec, self.bucket_bytes, self.groups.tp, bucket[0][1].dtype)
            self.bridge.broadcast_object({"plan": self.plan, "dtype": str(bucket[0][1].dtype)}, SENDER)
        if [(n, tuple(t.shape)) for n, t in bucket] != self.plan[index]:
            raise RuntimeError(f"bucket {index} of the weight stream is not the one planned: "
                               f"{[n for n, _ in bucket][:3]} vs {[n for n, _ in self.plan[index]][:3]}")
        if self.verify != "off":
            digests += [_host(weight_digest(t, self.verify)) for _, t in bucket]
        flat = self.buffer.get(sum(t.numel() for _, t in bucket), bucket[0][1].dtype, self.bridge.device)
        offset = 0
        for _, t in bucket:
            flat[offset:offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        self.bridge.broadcast(flat, SENDER)
        return flat.nbytes


class WeightReceiver:
    """Rollout side: every rollout rank calls `receive` when the trainers send; returns the version."""

    def __init__(self, bridge, verify: str):
        self.bridge, self.verify = bridge, verify
        self.buffer = _Buffer()
        self.plan = self.dtype = None

    def receive(self, engine) -> int:
        if self.plan is None:
            first = self.bridge.broadcast_object(None, SENDER)
            self.plan, self.dtype = first["plan"], _DTYPES[first["dtype"]]
        errors, received = [], []
        for layout in self.plan:
            flat = self.buffer.get(sum(torch.Size(s).numel() for _, s in layout), self.dtype, self.bridge.device)
            self.bridge.broadcast(flat, SENDER)
            bucket, offset = [], 0
            for name, shape in layout:
                n = torch.Size(shape).numel()
                bucket.append((name, flat[offset:offset + n].view(shape)))
                offset += n
            errors += self._load(engine, bucket, received)
        meta = self.bridge.broadcast_object(None, SENDER)
        if meta["digests"] is not None:
            names = [n for layout in self.plan for n, _ in layout]
            errors += [f"rank {dist.get_rank()} of the rollout world received {name!r} with a different "
                       f"{self.verify} than was sent" for name, ours, sent in zip(names, received, meta["digests"])
                       if not _same(ours, sent)]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errors[:3])  # the rollout world: one verdict for all of it
        first = next((e for part in gathered for e in part), None)
        self.bridge.broadcast_object(first, self.bridge.members[1])
        return int(meta["version"])

    def _load(self, engine, bucket, received: list) -> list:
        """Digests of the bytes received (appended to `received`, checked against the sender's at the end
        of the sync), then errors of the store: an engine copy that differs from them."""
        if self.verify != "off":
            received += [weight_digest(t, self.verify) for _, t in bucket]
        stored = engine.load_weights(bucket, self.verify)
        if self.verify == "off":
            return []
        errors = []
        for name, t in bucket:
            if name not in stored:
                errors.append(f"engine did not report tensor {name!r}: it was sent but not stored")
            elif not _same(stored[name].digest, weight_digest(hf_region(t, stored[name].region), self.verify)):
                errors.append(f"engine's stored copy of {name!r} (slice {stored[name].region}) differs from what "
                              f"it received")
        return errors


def _host(digest):
    return digest.cpu() if isinstance(digest, torch.Tensor) else digest


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu() if isinstance(b, torch.Tensor) else torch.as_tensor(b))
    return a == b
