"""Weights from the trainer ranks to rollout ranks of their own (split placement), verified.

One stream per pipeline stage and expert-parallel rank of the trainers' DP-0 replica (`weight_streams`):
the TP ranks of that stage walk the colocated HF path's bucket stream (`iter_hf_weights`, TP-gathered,
HF-named, bounded buckets) over the tensors their stage holds (`stream_names`: experts from the EP rank
holding them, everything else from EP rank 0), with no PP or EP broadcast, and their TP-0 rank broadcasts
each bucket's bytes over a `Bridge` of its own to every rollout rank. Shard to shard (`sends_shards`: the
native engine at the trainers' TP, EP 1) every TP rank of a stage is a sender: its own megatron shards, as
they are, to the rollout ranks of its TP rank, which copy them into their parameters (`load_shards`). The
streams run at once; each rollout rank takes bucket k of every stream before bucket k+1 of any (its engine
loads from one thread, in one order on every rollout rank), while the next buckets are already on their way.

The bucket plan of a stream (name, shape and dtype of every tensor of every bucket: `bucket_plan`, fixed by
the model and the bucket size) goes once, on the first sync; each sync then sends only bytes, and one message at its end
with the version and the sender's digest of every tensor. Each rollout rank digests the bytes it received
(checked against the sender's at the end: the transport), loads each bucket into its engine, and checks
what the engine read back from its own parameters against the received slice (the store). One verdict per
sync returns to every sender and from them to every trainer rank, so a bad handoff stops every rank with
the same HandoffError; so does a disagreement of the streams' versions, and a sender whose stream departs
from its plan (it sends zeros of the planned buckets, so no receiver waits forever, and names the fault in
its closing message).

Double buffering: a sender packs bucket k into buffer k % 2 (once bucket k-2's broadcast from it has ended)
and starts its broadcast, then gathers bucket k+1 (the TP collectives) and packs it while k is on the bridge:
at most two buckets of a stream in flight. A sender holds at most two packed buckets beside the stream's staging (one bucket and one
tensor's scratch, `iter_hf_weights`); a rollout rank holds two buffers of each stream's largest bucket
(2 x streams buckets), each receiving one bucket while the engine loads from the other.
A bucket travels as bytes: each tensor in its own dtype (a bf16 model built with the local spec keeps fp32
norms), at an offset aligned to its element size (`_offsets`).
`perf/weight_sync_bytes` is the bytes put on the bridges per sync, summed over the senders: every HF
tensor once (sum of numel x element size, plus any alignment between tensors of different element sizes).

Placement must not import engines or the trainer: the engine is any object with `load_weights`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybridrl.models.gpt import GPTSpec
from hybridrl.placement.fingerprint import weight_digests
from hybridrl.models import hf_convert as hc
from hybridrl.models.hf_checkpoint import global_weight_state, sample_weight
from hybridrl.placement.readback import HandoffError, digests_as_stored, shard_hf_parts, stored_shard_error
from hybridrl.placement.reshard import iter_hf_weights

SENDER = 0
"""Global rank that speaks for the trainers on the control bridge (DP 0, TP 0, PP 0); it sends stage 0's weights."""

BYTES, MAX_BYTES = "perf/weight_sync_bytes", "perf/weight_sync_sender_max_bytes"
"""What one sync put on the weight bridges, summed over the senders, and the most one sender put on its bridge
(the stream that bounds the sync's time)."""

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


class _Buffer:
    """One flat byte buffer reused for every bucket, grown when a bucket needs more."""

    def __init__(self):
        self.t = None

    def get(self, nbytes: int, device) -> torch.Tensor:
        if self.t is None or self.t.numel() < nbytes or self.t.device != device:
            self.t = None  # the old one goes before the larger one comes
            self.t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.t[:nbytes]


def _offsets(layout) -> tuple[list, int]:
    """(byte offset of each tensor of a bucket's layout [(name, shape, dtype name)], the bucket's bytes): in
    order, each aligned to its element size (a view of the byte buffer as that dtype needs it)."""
    offsets, end = [], 0
    for _, shape, dtype in layout:
        size = _DTYPES[dtype].itemsize
        start = -(-end // size) * size
        offsets.append(start)
        end = start + torch.Size(shape).numel() * size
    return offsets, end


def _views(flat: torch.Tensor, layout) -> list:
    """(name, tensor) of each entry of `layout`, a view of the byte buffer `flat` in its dtype and shape."""
    offsets, _ = _offsets(layout)
    return [(name, flat[o:o + torch.Size(shape).numel() * _DTYPES[dtype].itemsize].view(_DTYPES[dtype]).view(shape))
            for (name, shape, dtype), o in zip(layout, offsets)]


def _layout(bucket) -> list:
    """[(name, shape, dtype name)] of a bucket's tensors: what its plan entry must say."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in bucket]


def weight_streams(layouts: list, ep: int, shards: bool = False) -> list[tuple[int, int, int]]:
    """(sender's global rank, stage, EP rank) of each weight stream, in stream order; `layouts[r]` is trainer
    rank r's (dp_rank, cp_rank, pp_rank, ep_rank, tp_rank). The DP-0 replica and its expert-parallel peers
    (DP ranks < ep) hold every tensor; each (stage, EP rank) sends from its lowest TP-0 rank, or with `shards`
    (`sends_shards`) every TP rank of a stage sends its own shards: one stream per (stage, TP rank)."""
    first = {}
    for rank, (dp, _, pp, ep_rank, tp) in enumerate(layouts):
        if (tp == 0 or shards) and dp < ep:
            first.setdefault((pp, ep_rank, tp if shards else 0), rank)
    return [(rank, pp, ep_rank) for (pp, ep_rank, _), rank in sorted(first.items())]


def my_stream(streams: list, layouts: list, rank: int):
    """The stream trainer rank `rank` walks: its own, or that of its TP group's sender (same DP, CP, stage
    and EP rank: the TP collectives of the HF stream), or None."""
    return next((s for s in streams if s[0] == rank), None) or \
        next((s for s in streams if layouts[s[0]][:4] == layouts[rank][:4]), None)


def sends_shards(engine_name: str, rollout_tp: int, tp: int, ep: int) -> bool:
    """Shard to shard: the native engine at the trainers' TP (and EP 1) holds each trainer TP rank's shards as
    they are (same dtype: both are model.params_dtype), so each TP rank sends its own, in megatron layout, to
    the rollout ranks of the same TP rank: no TP gather, no HF conversion, 1/tp of the weights per sender."""
    return engine_name == "native" and rollout_tp == tp and ep == 1


def stream_members(streams: list, layouts: list, rollout_ranks: list, rollout_tp: int, shards: bool) -> list:
    """[sender, its receivers] per stream: every rollout rank, or with `shards` those at the sender's TP rank
    (rollout TP groups are consecutive ranks of the rollout world)."""
    return [[s] + [r for i, r in enumerate(rollout_ranks) if not shards or i % rollout_tp == layouts[s][4]]
            for s, _, _ in streams]


def shard_buckets(model, spec: GPTSpec, groups, names: list, bucket_bytes: int) -> list:
    """[[(global megatron name, this rank's shard), ...] per bucket] over `names` (this rank's stage and EP rank):
    views of the parameters, whole shards summing to <= bucket_bytes (one larger shard alone)."""
    local, buckets, held = global_weight_state(model, spec, groups), [[]], 0
    for name in names:
        shard = local[name].detach()
        if buckets[-1] and held + shard.nbytes > bucket_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append((name, shard))
        held += shard.nbytes
    return buckets if buckets[-1] else []


def stream_names(spec: GPTSpec, stage: int, ep_rank: int, pp: int, ep: int) -> list[str]:
    """The megatron names (model order) of one stream: stage `stage`'s tensors, experts of EP rank `ep_rank`
    and, on EP rank 0, every tensor that is not an expert's."""
    return [g for g in hc.hf_to_mcore_name_map(spec)
            if hc.owner_stage(g, spec, pp) == stage and (hc.owner_ep_rank(g, spec, ep) or 0) == ep_rank]


def bucket_plan(spec: GPTSpec, bucket_bytes: int, tp: int, dtype: torch.dtype, names=None) -> list:
    """[[(hf_name, shape, dtype name), ...] per bucket]: the buckets `iter_hf_weights` yields over `names` (all
    by default) from a model of `dtype`, without any data (whole megatron tensors whose full sizes at training
    TP, in `dtype`, sum to <= bucket_bytes, one if larger; each tensor in the dtype it is held in,
    `hf_convert.held_dtype`)."""
    shapes, plan, bucket, held = hc.hf_shapes(spec), [], [], 0
    for global_name in hc.hf_to_mcore_name_map(spec) if names is None else names:
        size = torch.Size(hc.mcore_full_shape(global_name, spec, tp)).numel() * dtype.itemsize
        if bucket and held + size > bucket_bytes:
            plan.append(bucket)
            bucket, held = [], 0
        held_as = str(hc.held_dtype(global_name, spec, dtype))
        bucket += [(hf, tuple(shapes[hf]), held_as) for hf in hc.hf_sources(global_name, spec)]
        held += size
    return plan + ([bucket] if bucket else [])


class WeightSender:
    """Trainer side: every trainer rank calls `send` (SPMD). The TP group of each stream's sender walks that
    stream (`stream`: (sender, stage, EP rank), None elsewhere: those return at once); `bridge` is the
    stream's on its sender, else None."""

    def __init__(self, bridge, stream, groups, spec: GPTSpec, bucket_mb: float, verify: str, shards: bool = False):
        self.bridge, self.groups, self.spec, self.shards = bridge, groups, spec, shards
        self.bucket_bytes, self.verify = int(bucket_mb * 2 ** 20), verify
        self.names = None if stream is None else stream_names(spec, stream[1], stream[2], groups.pp, groups.ep)
        self.buffers = (_Buffer(), _Buffer())
        self.plan, self.dtype, self.fault = None, None, None
        """The bucket plan and the model's dtype once sent (first sync): later syncs send bytes only."""

    def send(self, model, version: int) -> dict:
        start = time.perf_counter()
        sent, buckets, verdict = self._walk(model, version) if self.names is not None else (0, 0, None)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (verdict, sent, buckets))  # every trainer rank raises the same error
        verdict = next((v for v, _, _ in parts if v), None)
        if verdict:
            raise HandoffError(verdict)
        return {"perf/weight_sync_s": time.perf_counter() - start, BYTES: float(sum(p[1] for p in parts)),
                MAX_BYTES: float(max(p[1] for p in parts)), "perf/weight_sync_buckets": float(sum(p[2] for p in parts))}

    def _walk(self, model, version: int) -> tuple:
        """(bytes sent, buckets sent, the rollout ranks' verdict) on the sender; (0, 0, None) on its TP peers."""
        sent, buckets, digests, in_flight = 0, 0, [], [None, None]
        if self.plan is None:  # the model's dtype (its weight matrices'), which the plan's bucket sizes count in
            self.dtype = sample_weight(model).dtype
        if not self.names:
            stream = ()
        elif self.shards:  # views only: the plan is known before any byte moves
            stream = shard_buckets(model, self.spec, self.groups, self.names, self.bucket_bytes)
            if self.plan is None and stream:
                self._send_plan([_layout(b) for b in stream])
        else:
            stream = iter_hf_weights(model, self.spec, self.groups, self.bucket_bytes, self.names)
        self.fault = None
        for bucket in stream:
            if self.bridge is not None:
                sent += self._send_bucket(buckets, bucket, digests, in_flight)
            buckets += 1
        if self.bridge is None:
            return 0, 0, None
        if self.plan is None:  # a stream without tensors still announces its (empty) plan
            self._send_plan()
        for index in range(buckets, len(self.plan)):  # the stream ended early: the receivers still expect these
            self._faulty(f"it ended after {buckets} of the {len(self.plan)} buckets planned")
            sent += self._send_bucket(index, self._zeros(index), digests, in_flight)
        for wait in in_flight:
            if wait is not None:
                wait()
        src, leader = self.bridge.members[:2]
        digests = [_host(d) for d in digests] if self.verify != "off" else None
        self.bridge.broadcast_object({"version": version, "digests": digests, "fault": self.fault}, src)
        return sent, buckets, self.bridge.broadcast_object(None, leader)

    def _send_plan(self, plan=None) -> None:
        self.plan = plan if plan is not None else bucket_plan(self.spec, self.bucket_bytes, self.groups.tp,
                                                              self.dtype, self.names)
        self.bridge.broadcast_object({"plan": self.plan, "dtype": str(self.dtype)}, self.bridge.members[0])

    def _faulty(self, what: str) -> None:
        """Note the stream's first departure from its plan; it reaches every rank in the sync's verdict."""
        if self.fault is None:
            self.fault = (f"the weight stream of trainer rank {dist.get_rank()} departed from the bucket plan it sent "
                          f"at the first sync: {what}; the model's tensors or the bucket size changed since (the "
                          f"rollout ranks got zeros in place of those buckets)")

    def _zeros(self, index: int) -> list:
        """Planned bucket `index` filled with zeros: what goes on the bridge in place of a departing bucket, so
        every receiver's posted broadcast completes and the verdict, not a hang, ends the sync."""
        return [(n, torch.zeros(shape, dtype=_DTYPES[dtype], device=self.bridge.device))
                for n, shape, dtype in self.plan[index]]

    def _send_bucket(self, index: int, bucket, digests: list, in_flight: list) -> int:
        """Pack bucket `index` into its buffer (once bucket index-2 has left it) and start its broadcast."""
        if self.plan is None:  # first sync: the plan, once, before any bytes
            self._send_plan()
        if index >= len(self.plan):  # past the plan: the receivers expect nothing more
            self._faulty(f"bucket {index} ({[n for n, _ in bucket][:3]}) is past the {len(self.plan)} planned")
            return 0
        layout = _layout(bucket)
        if layout != self.plan[index]:
            wrong = next((ours, planned) for ours, planned in zip(layout + [None], self.plan[index] + [None])
                         if ours != planned)
            self._faulty(f"bucket {index} holds {[n for n, _ in bucket][:3]}, the plan "
                         f"{[n for n, _, _ in self.plan[index]][:3]} (first difference: {wrong[0]} where the plan "
                         f"has {wrong[1]})")
            bucket = self._zeros(index)
        if self.verify != "off":
            digests += weight_digests([t for _, t in bucket], self.verify)  # to the host at the end: no sync here
        slot = index % 2
        if in_flight[slot] is not None:
            in_flight[slot]()
        layout = self.plan[index]
        flat = self.buffers[slot].get(_offsets(layout)[1], self.bridge.device)
        for (_, view), (_, t) in zip(_views(flat, layout), bucket):
            view.copy_(t)
        in_flight[slot] = self.bridge.start_broadcast(flat, self.bridge.members[0])
        return flat.nbytes


class _Incoming:
    """One stream on a rollout rank: its plan and two buffers, each receiving one bucket at a time."""

    def __init__(self, bridge):
        self.bridge, self.plan, self.dtype = bridge, None, None
        self.buffers, self.posted = (_Buffer(), _Buffer()), {}

    def start(self) -> None:
        if self.plan is None:
            first = self.bridge.broadcast_object(None, self.bridge.members[0])
            self.plan, self.dtype = first["plan"], _DTYPES[first["dtype"]]
        self.post(0)
        self.post(1)

    def post(self, k: int) -> None:
        """Start receiving bucket k into buffer k % 2 (free: bucket k-2 was loaded from it)."""
        if k < len(self.plan):
            flat = self.buffers[k % 2].get(_offsets(self.plan[k])[1], self.bridge.device)
            self.posted[k] = (flat, self.bridge.start_broadcast(flat, self.bridge.members[0]))

    def take(self, k: int) -> list:
        """Bucket k as (hf_name, view of its buffer in the tensor's dtype), once received."""
        flat, wait = self.posted.pop(k)
        wait()
        return _views(flat, self.plan[k])


class WeightReceiver:
    """Rollout side: every rollout rank calls `receive` when the trainers send; returns the version.
    `bridges`: one per stream, in stream order."""

    def __init__(self, bridges: list, verify: str, shards=None):
        self.streams, self.verify = [_Incoming(b) for b in bridges], verify
        self.shards = shards
        """(spec, tp, tp_rank) where the streams carry megatron shards at the engine's layout (`sends_shards`)."""

    def receive(self, engine) -> int:
        for s in self.streams:
            s.start()
        errors, received = self._layout_errors(engine), [[] for _ in self.streams]
        load = not errors  # else every bucket is still taken (the senders go on), none loaded
        for k in range(max((len(s.plan) for s in self.streams), default=0)):
            for s, got in zip(self.streams, received):  # bucket k of every stream, then k+1: one order everywhere
                if k < len(s.plan):
                    bucket = s.take(k)
                    errors += self._load(engine, bucket, got) if load else []
                    s.post(k + 2)
        metas = [s.bridge.broadcast_object(None, s.bridge.members[0]) for s in self.streams]
        errors[:0] = [m["fault"] for m in metas if m.get("fault")]  # first: it explains any other error
        for s, got, meta in zip(self.streams, received, metas):
            if meta["digests"] is not None:
                names = [n for layout in s.plan for n, _, _ in layout]
                errors += [f"rank {dist.get_rank()} of the rollout world received {name!r} with a different "
                           f"{self.verify} than was sent" for name, ours, sent in zip(names, got, meta["digests"])
                           if not _same(ours, sent)]
        versions = sorted({int(m["version"]) for m in metas})
        if len(versions) > 1:
            errors.append(f"the weight streams of one sync carry different versions {versions}: the trainer "
                          "ranks did not send the same update")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errors[:3])  # the rollout world: one verdict for all of it
        first = next((e for part in gathered for e in part), None)
        for s in self.streams:
            s.bridge.broadcast_object(first, s.bridge.members[1])
        return versions[0]

    def _layout_errors(self, engine) -> list:
        """Shards are loaded as they come only into an engine at their layout (TP, TP rank and dtype)."""
        dtypes = {s.dtype for s in self.streams if s.plan}
        if self.shards is None or not dtypes:
            return []
        _, tp, tp_rank = self.shards
        theirs = (tp, tp_rank, dtypes.pop())
        if getattr(engine, "shard_layout", None) is None or engine.shard_layout() != theirs:
            ours = engine.shard_layout() if hasattr(engine, "shard_layout") else "no shard layout"
            return [f"rank {dist.get_rank()} of the rollout world received shards at (tp, tp_rank, dtype) {theirs}; "
                    f"its engine holds {ours}: nothing was loaded"]
        return []

    def _load(self, engine, bucket, received: list) -> list:
        """Digests of the bytes received (appended to `received`, checked against the sender's at the end
        of the sync), then errors of the store: an engine copy that differs from them."""
        if self.verify != "off":
            received += weight_digests([t for _, t in bucket], self.verify)
        if self.shards is not None:
            stored = engine.load_shards(bucket, self.verify)
            spec, tp, tp_rank = self.shards
            error = stored_shard_error(shard_hf_parts(bucket, spec, tp, tp_rank), stored, self.verify) \
                if self.verify != "off" else None
            return [error] if error else []
        stored = engine.load_weights(bucket, self.verify)
        if self.verify == "off":
            return []
        errors = [f"engine did not report tensor {name!r}: it was sent but not stored"
                  for name, _ in bucket if name not in stored]
        reported = [(name, t) for name, t in bucket if name in stored]
        ours = digests_as_stored(reported, stored, self.verify)
        return errors + [f"engine's stored copy of {name!r} (slice {stored[name].region}) differs from what it received"
                         for (name, _), digest in zip(reported, ours) if not _same(stored[name].digest, digest)]


def _host(digest):
    return digest.cpu() if isinstance(digest, torch.Tensor) else digest


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu() if isinstance(b, torch.Tensor) else torch.as_tensor(b))
    return a == b
