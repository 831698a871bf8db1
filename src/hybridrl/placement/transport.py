"""Weights from the trainer ranks to rollout ranks of their own (split placement), verified.

The trainers' DP-0 replica walks the same bucket stream as the colocated handoff (`iter_hf_weights`:
TP-gathered, PP-broadcast, HF-named, bounded buckets); global rank 0 broadcasts each bucket over a
`Bridge` to every rollout rank: first its names, shapes and digests, then its bytes packed into one
reused buffer. Each rollout rank checks the bytes it received against the sender's digests (the
transport), loads the bucket into its engine, and checks what the engine read back from its own
parameters against the received slice (the store). One verdict per sync returns to the trainers, so
a bad handoff stops every rank with the same HandoffError. No rank holds more than one bucket beyond
its own parameters.

Placement must not import engines or the trainer: the engine is any object with `load_weights`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridrl.models.gpt import GPTSpec
from hybridrl.placement.fingerprint import hf_region, weight_digest
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


class WeightSender:
    """Trainer side: every rank of the DP-0 replica calls `send` (the bucket stream is collective over
    it, and over its expert-parallel peers, DP ranks 1..ep-1, which walk it too); other DP ranks call it
    too and return at once. `bridge` is None except on the sender."""

    def __init__(self, bridge, groups, spec: GPTSpec, bucket_mb: float, verify: str):
        self.bridge, self.groups, self.spec = bridge, groups, spec
        self.bucket_bytes, self.verify = int(bucket_mb * 2 ** 20), verify
        self.buffer = _Buffer()

    def send(self, model, version: int) -> dict:
        start, sent, buckets = time.perf_counter(), 0, 0
        if self.groups.dp_rank < self.groups.ep:  # DP 0 and its expert-parallel peers (which hold the other experts)
            for bucket in iter_hf_weights(model, self.spec, self.groups, self.bucket_bytes):
                if self.bridge is not None:
                    sent += self._send_bucket(bucket)
                buckets += 1
        verdict = [None]
        if self.bridge is not None:
            self.bridge.broadcast_object({"last": True, "version": version}, SENDER)
            verdict = [self.bridge.broadcast_object(None, self.bridge.members[1])]
        dist.broadcast_object_list(verdict, src=0)  # every trainer rank raises the same error
        if verdict[0]:
            raise HandoffError(verdict[0])
        return {"perf/weight_sync_s": time.perf_counter() - start, "perf/weight_sync_bytes": float(sent),
                "perf/weight_sync_buckets": float(buckets)}

    def _send_bucket(self, bucket) -> int:
        meta = {"last": False, "names": [n for n, _ in bucket], "shapes": [tuple(t.shape) for _, t in bucket],
                "dtype": str(bucket[0][1].dtype),
                "digests": [_host(weight_digest(t, self.verify)) for _, t in bucket] if self.verify != "off" else None}
        self.bridge.broadcast_object(meta, SENDER)
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

    def receive(self, engine) -> int:
        errors = []
        while True:
            meta = self.bridge.broadcast_object(None, SENDER)
            if meta["last"]:
                break
            dtype = _DTYPES[meta["dtype"]]
            flat = self.buffer.get(sum(torch.Size(s).numel() for s in meta["shapes"]), dtype, self.bridge.device)
            self.bridge.broadcast(flat, SENDER)
            bucket, offset = [], 0
            for name, shape in zip(meta["names"], meta["shapes"]):
                n = torch.Size(shape).numel()
                bucket.append((name, flat[offset:offset + n].view(shape)))
                offset += n
            errors += self._load(engine, bucket, meta["digests"])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errors[:3])  # the rollout world: one verdict for all of it
        first = next((e for part in gathered for e in part), None)
        self.bridge.broadcast_object(first, self.bridge.members[1])
        return int(meta["version"])

    def _load(self, engine, bucket, digests) -> list:
        """Errors of one bucket: bytes that differ from what was sent, or a store that differs from them."""
        errors = []
        if digests is not None:
            for (name, t), sent in zip(bucket, digests):
                if not _same(weight_digest(t, self.verify), sent):
                    errors.append(f"rank {dist.get_rank()} of the rollout world received {name!r} with a "
                                  f"different {self.verify} than was sent")
        stored = engine.load_weights(bucket, self.verify)
        if self.verify == "off":
            return errors
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
