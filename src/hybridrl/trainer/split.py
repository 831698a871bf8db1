"""Split placement: the trainers' side (`RolloutClient`) and the rollout ranks' loop (`serve_rollout`).

The last `placement.rollout_world_size` ranks of the job only generate. Between the two roles runs one
ordered conversation over the `control` bridge (the trainer and rollout ranks are its members): the
trainers' rank 0 sends `generate`, `weights` or `stop`; the rollout leader answers each `generate` with the
responses of the whole request, in chunks of `async_training.stream_prompts` prompts when streaming.
A message is never sent while an answer is owed, so the two sides cannot cross. Weights follow a
`weights` message over their own bridge (`placement.transport`). Every answer carries the weight
version that generated it: with `staleness_threshold` 1 the trainers submit batch k+1 right after
receiving batch k and send update k's weights only after receiving batch k+1, so generation of
k+1 overlaps the update on k and every trained sample is exactly one version old.
"""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time

import torch
import torch.distributed as dist

from hybridrl.config import Config
from hybridrl.parallel.split_world import Bridge, SplitWorld
from hybridrl.placement.reshard import HandoffError
from hybridrl.placement.transport import (BYTES, MAX_BYTES, SENDER, WeightReceiver, WeightSender, my_stream,
                                          sends_shards, stream_members, weight_streams)
from hybridrl.rollout.base import RolloutOutput, SamplingParams
from hybridrl.trainer.split_partial import _PartialWeights, claim_answer, queue_answer
from hybridrl.trainer.rollout_rows import (full_rows, group_messages, join_outputs, merge_messages, output_rows,
                                           row_versions, tensor_bytes)


class PeerLostError(RuntimeError):
    """The other role stopped answering (its process died or broke off); names role, ranks and phase."""

    exit_at_once = True
    """The process ends right after its error line (hybridrl.log.run_cli): nothing can be said to a hung peer."""


@contextlib.contextmanager
def talking_to(role: str, ranks: list, phase: str):
    """Turn a broken connection to the other role, or its silent heartbeats, into one PeerLostError naming
    who and when."""
    try:
        yield
    except (PeerLostError, HandoffError):  # a bad handoff is the verdict of live peers, not a lost one
        raise
    except (RuntimeError, ConnectionError) as err:  # gloo/nccl report a dead peer as RuntimeError subclasses
        dead = getattr(err, "ranks", None)  # liveness.PeerDied: the silent ranks themselves
        if dead:
            role, ranks = (role if set(dead) <= set(ranks) else "a"), dead
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise PeerLostError(f"{role} {who} died or stopped answering during {phase} ({reason}); "
                            f"the job stops: see that rank's log, then resume from the last checkpoint") from None


def control_bridge(world: SplitWorld) -> Bridge:
    return Bridge(world, "control", world.ranks_of("train") + world.rollout_ranks)


def weights_bridges(world: SplitWorld, members: list) -> list[Bridge]:
    """One bridge per weight stream over its members ([sender, receivers], `transport.stream_members`; nccl on
    GPU, gloo on CPU): those a rank belongs to, in stream order (on a trainer rank the one it sends on, or none)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return [Bridge(world, f"weights/{i}", m, backend) for i, m in enumerate(members) if world.rank in m]


class RolloutClient:
    """The trainers' handle on the rollout ranks; every trainer rank calls every method (SPMD)."""

    def __init__(self, cfg: Config, world: SplitWorld, groups, spec, pad_id: int):
        from hybridrl.models.hf_config import spec_to_dict

        self.cfg, self.world, self.groups, self.pad_id = cfg, world, groups, pad_id
        self.lost = False
        r = cfg.rollout
        with self._peer("start-up"):
            self.control = control_bridge(world)
        self.owed = None
        """The request whose answer has not been received yet: (rows per DP rank, key)."""
        self.answer = ([], [])
        """(global prompt indices, every message) of the last request: what a checkpoint keeps of it."""
        self.wait_s = 0.0
        self.last_width = 0
        """Response width of the last answer (an empty result of a rank with no prompts has it)."""
        self.spans = []
        """(global rank, phase, start, end) of the rollout ranks, as their answers bring them."""
        self.on_wait = None
        """Called as on_wait(start, end) (perf_counter seconds) after each wait for an answer."""
        self.rows_bytes = {}
        """step -> bytes of row tensors this rank received for that step's batch (perf/rows_bytes)."""
        self.sync_bytes = {}
        """version -> {perf/weight_sync_bytes: what the senders put on the weight bridges for those weights,
        perf/weight_sync_sender_max_bytes: the most one of them did}."""
        layouts = [None] * dist.get_world_size()
        g = groups
        dist.all_gather_object(layouts, (g.dp_rank, g.cp_rank, g.pp_rank, g.ep_rank, g.tp_rank))
        self.shards = sends_shards(r.name, r.tensor_model_parallel_size, groups.tp, groups.ep)
        streams = weight_streams(layouts, groups.ep, self.shards)
        members = stream_members(streams, layouts, world.rollout_ranks, r.tensor_model_parallel_size, self.shards)
        self._send({"kind": "hello", "spec": spec_to_dict(spec), "dp_of": [x[0] for x in layouts],
                    "streams": members, "shards": self.shards})
        with self._peer("start-up"):
            mine = weights_bridges(world, members)
            self.sender = WeightSender(mine[0] if mine else None, my_stream(streams, layouts, world.rank), groups,
                                       spec, r.update_weights_bucket_mb, r.verify_weights, self.shards)

    def _send(self, msg) -> None:
        with self._peer(f"the {msg['kind'] if msg else 'next'} request" if self.world.rank == SENDER else "a request"):
            self.control.broadcast_object(msg if self.world.rank == SENDER else None, SENDER)

    @contextlib.contextmanager
    def _peer(self, phase: str):
        try:
            with talking_to("rollout", self.world.rollout_ranks, phase):
                yield
        except PeerLostError:
            self.lost = True  # nothing more to say to the rollout ranks (`Pipeline.stop` skips its goodbye)
            raise

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, prompt_ids: list, seeds: list, sampling: SamplingParams, key) -> None:
        """Ask for responses to this DP rank's prompts (collective over the trainers); `key` is
        (step, this rank's prompt indices, sampling)."""
        assert self.owed is None, "one request at a time: receive the owed answer first"
        parts = [None] * self.groups.dp
        dist.all_gather_object(parts, (prompt_ids, seeds, key), group=self.groups.dp_group)
        counts = [len(p[0]) for p in parts]
        self.answer = ([i for p in parts for i in p[2][1]], [])
        if self.cfg.async_training.partial_rollout and self.world.rank == SENDER:
            queue_answer(self.world.store)
        self._send({"kind": "generate", "prompts": [x for p in parts for x in p[0]],
                    "seeds": [s for p in parts for s in p[1]], "sampling": sampling,
                    "stream": self.cfg.async_training.stream_prompts, "counts": counts})
        self.owed = (counts, key)

    def receive(self):
        """Yield (RolloutOutput of this DP rank's rows [lo, hi) of its prompts, lo, hi, version) per chunk
        as the answer arrives; the rows of a chunk are whole prompt groups."""
        counts, key = self.owed
        self.owed = None
        lo_rank = sum(counts[:self.groups.dp_rank])
        while True:
            start = time.perf_counter()
            with self._peer("generation (waiting for responses)"):
                msg = self.control.recv_object(self.world.rollout_leader)
            self.rows_bytes[key[0]] = self.rows_bytes.get(key[0], 0) + tensor_bytes(msg["out"])
            self.wait_s += time.perf_counter() - start
            if self.on_wait is not None:
                self.on_wait(start, time.perf_counter())
            self.spans += msg.pop("spans")
            self.answer[1].append(msg)
            self.last_width = msg["out"].responses.shape[1]
            yield from my_rows(msg, lo_rank, lo_rank + counts[self.groups.dp_rank])
            if msg["last"]:
                return

    def trim_spans(self, before: float) -> None:
        """Forget the rollout ranks' spans that ended before `before` (seconds since the epoch)."""
        self.spans = [s for s in self.spans if s[3] >= before]

    def take_wait(self) -> float:
        """Seconds spent waiting for answers since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def sync(self, model, version: int) -> dict:
        """Send the current weights, as `version` (collective over the trainers)."""
        assert self.owed is None, "receive the owed answer before sending weights"
        self._send({"kind": "weights"})
        return self.send_weights(model, version)

    def send_weights(self, model, version: int) -> dict:
        with self._peer("the weight sync"):
            report = self.sender.send(model, version)
        # booked under the step whose update these weights are (split_perf), not logged again with this step
        booked = self.sync_bytes.setdefault(version, {BYTES: 0.0, MAX_BYTES: 0.0})
        booked[BYTES] += report.pop(BYTES)
        booked[MAX_BYTES] = max(booked[MAX_BYTES], report.pop(MAX_BYTES))
        return report

    def claim_generation(self) -> bool:
        """Partial rollout: whether the answer in flight is still to come (queued, or being generated), in which
        case the rollout ranks now take the next weights between two decode steps (agreed by all trainer ranks)."""
        box = [None]
        if self.world.rank == SENDER:
            box[0] = claim_answer(self.world.store)
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def stop(self) -> None:
        if self.owed is not None:
            list(self.receive())
        self._send({"kind": "stop"})
        with self._peer("the end of the run"):
            self.spans += self.control.broadcast_object(None, self.world.rollout_leader)


def my_rows(msg: dict, lo_rank: int, hi_rank: int):
    """The part of one answer message (rows of prompts [msg lo, msg hi) of the request) that falls in this
    rank's prompts [lo_rank, hi_rank), as (output, lo, hi, version) with lo/hi relative to the rank's prompts."""
    lo, hi = max(msg["lo"], lo_rank), min(msg["hi"], hi_rank)
    if lo < hi:
        n = msg["n"]
        out = full_rows(output_rows(msg["out"], slice((lo - msg["lo"]) * n, (hi - msg["lo"]) * n)))
        yield out, lo - lo_rank, hi - lo_rank, row_versions(out, msg["version"])


# ---- the rollout ranks ---------------------------------------------------------------------------

def serve_rollout(cfg: Config, world: SplitWorld) -> int:
    """The loop of a rollout rank: build the engine, then answer the trainers until `stop`."""
    from hybridrl.models.hf_config import spec_from_dict
    from hybridrl.parallel.distributed import run_device
    from hybridrl.placement.reshard import new_rollout_groups
    from hybridrl.rollout.agent_loop import AgentLoop
    from hybridrl.timeline import Timeline
    from hybridrl.tokenizer import load_data_tokenizer
    from hybridrl.trainer.roles import build_rollout

    trainers = world.ranks_of("train")
    with talking_to("trainer", trainers, "start-up"):  # the trainers may build their models for long
        control = control_bridge(world)
        hello = control.broadcast_object(None, SENDER)
        receiver = WeightReceiver(weights_bridges(world, hello["streams"]), cfg.rollout.verify_weights)
    tokenizer = load_data_tokenizer(cfg.data, cfg.model.path)
    groups = new_rollout_groups(cfg.rollout.tensor_model_parallel_size)
    spec = spec_from_dict(hello["spec"])
    engine = build_rollout(cfg, spec, groups, tokenizer)
    if hello["shards"]:
        receiver.shards = (spec, groups.tp, groups.tp_rank)
    agent = AgentLoop(cfg.rollout.multi_turn, tokenizer) if cfg.rollout.multi_turn.enable else None
    server = _Server(control, world, engine, agent, groups, Timeline(world.rank, "rollout"), hello["dp_of"])
    partial = None
    if cfg.async_training.partial_rollout:
        partial = _PartialWeights(world.store, receiver, engine, world.rank == world.rollout_leader, run_device(),
                                  server.timeline)
        engine.between_steps = partial.between_steps
    version = -1  # no weights yet
    while True:
        with talking_to("trainer", trainers, "the wait for a request"), server.timeline.span("wait_request"):
            msg = control.broadcast_object(None, SENDER)
        if msg["kind"] == "stop":
            with talking_to("trainer", trainers, "the end of the run"):
                control.broadcast_object(server.gather_spans(), world.rollout_leader)
            return 0
        if msg["kind"] == "weights":
            with talking_to("trainer", trainers, "the weight sync"), server.timeline.span("update_weights"):
                version = receiver.receive(engine)
            continue
        with talking_to("trainer", trainers, "sending responses"):
            version = server.answer(msg, version, partial)


class _Server:
    """Answers one `generate` request: chunk by chunk (each engine replica takes a contiguous share of
    a chunk), each chunk sent from a thread as soon as it is complete, so generation never waits for
    the trainers to take it. Spans of every rollout rank ride along with the answers."""

    def __init__(self, control: Bridge, world: SplitWorld, engine, agent, groups, timeline, dp_of: list):
        self.control, self.engine, self.agent, self.groups = control, engine, agent, groups
        self.timeline, self.dp_of = timeline, dp_of
        """dp_of[r]: the DP rank of trainer rank r (the rows it receives are its DP group's)."""
        self.leader = world.rank == world.rollout_leader

    def gather_spans(self):
        return spans_to_leader(self.timeline)

    def answer(self, msg, version: int, partial=None) -> int:
        """Generate and send one request; returns the weight version the engine holds afterwards (partial
        rollout may have taken in new weights on the way)."""
        prompts, seeds, sampling = msg["prompts"], msg["seeds"], msg["sampling"]
        if partial is not None:
            partial.version = version
            partial.begin()
        outbox, failed = queue.Queue(), []
        sender = threading.Thread(target=self._send_all, args=(outbox, failed, msg["counts"]), daemon=True)
        if self.leader:  # the only rollout rank that talks to the trainers
            sender.start()
        step = msg["stream"] or max(len(prompts), 1)
        # a round of generation gives every engine replica work: chunks smaller than the number of replicas
        # are generated `replicas` prompts at a time (one replica each) and still sent chunk by chunk
        span = max(step, self.groups.dp) if msg["stream"] else step
        for lo in range(0, max(len(prompts), 1), span):
            if failed:
                break
            hi = min(lo + span, len(prompts))
            a, b = _replica_share(lo, hi, self.groups)
            start_version = partial.version if partial is not None else version
            with self.timeline.span("gen"):
                if self.agent is not None:
                    out = self.agent.generate(self.engine, prompts[a:b], sampling, seeds[a:b])
                else:
                    out = self.engine.generate(prompts[a:b], sampling, seeds[a:b])
            if partial is not None and hi >= len(prompts):
                partial.end()
            parts = to_leader(((a, b), out if self.groups.tp_rank == 0 else None, self.timeline.take()))
            if self.leader:
                outs = [o for (x, y), o, _ in sorted(parts, key=lambda p: p[0][0]) if o is not None and y > x]
                out = join_outputs(outs, self.engine.pad_id) if outs else out
                spans = [x for _, _, part in parts for x in part]
                for c in range(lo, max(hi, lo + 1), step):  # the round's chunks; its spans ride on the first
                    end = min(c + step, hi)
                    rows = slice((c - lo) * sampling.n, (end - lo) * sampling.n)
                    outbox.put({"lo": c, "hi": end, "n": sampling.n, "version": start_version,
                                "last": end >= len(prompts), "spans": spans if c == lo else [],
                                "out": out if span == step else  # counters once, with the first chunk
                                dataclasses.replace(output_rows(out, rows), stats=out.stats if c == lo else {})})
        outbox.put(StopIteration)
        if self.leader:
            sender.join()
        if failed:
            raise failed[0]
        return partial.version if partial is not None else version

    def _send_all(self, outbox, failed, counts: list) -> None:
        """Each trainer rank gets its DP group's rows of each chunk (every rank of the group the same)."""
        while (msg := outbox.get()) is not StopIteration:
            try:
                self.control.send_to_groups(group_messages(msg, counts), dict(enumerate(self.dp_of)))
            except BaseException as err:  # re-raised on the main thread
                failed.append(err)
                return


def to_leader(obj) -> list | None:
    """`obj` of every rank of this role's world (the rollout or the critic ranks), in rank order, on the role's
    first rank (None elsewhere)."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts


def spans_to_leader(timeline) -> list | None:
    """The timeline spans of every rank of this role's world since the last call, as (global rank, phase, start,
    end), on the role's first rank (None elsewhere; collective)."""
    parts = to_leader(timeline.take())
    return [x for part in parts for x in part] if parts is not None else None


def _replica_share(lo: int, hi: int, groups) -> tuple[int, int]:
    """The [a, b) of prompts [lo, hi) that this rank's engine replica generates."""
    n, replicas = hi - lo, groups.dp
    a = lo + (n * groups.dp_rank) // replicas
    return a, lo + (n * (groups.dp_rank + 1)) // replicas


class Pipeline:
    """How far generation runs ahead of training (`async_training.staleness_threshold`), over a client.

    s = 0: weights go out right after each update, and every batch is generated with them.
    s = 1: `prefetch` submits batch k+1 right after batch k arrives, before the update on k; update
    k's weights wait until batch k+1 is received (`updated` only marks them), so they never cross it.
    Answers are looked up by key: a prefetched batch is used by the step it was submitted for."""

    def __init__(self, client: RolloutClient, staleness: int, partial: bool = False):
        self.client, self.staleness, self.partial = client, staleness, partial
        self.held = {}
        """key -> this rank's chunks of an answer received before its step asked for it."""
        self.owed_key = None
        self.pending = None
        """(model, version) whose weights still have to reach the engines."""
        self.saved_answer = None
        self.restored = None
        """A checkpoint's in-flight batch, until its step asks for it."""

    def generate(self, ids: list, seeds: list, sampling: SamplingParams, key):
        """(output of this rank's prompts, the weight version behind each of its rows)."""
        chunks = list(self.stream(ids, seeds, sampling, key))
        if not chunks:  # no prompt of this DP rank in the request
            empty = torch.zeros(0, self.client.last_width)
            return RolloutOutput(empty.long(), empty, empty.clone()), torch.zeros(0, dtype=torch.long)
        chunks.sort(key=lambda c: c[1])
        return join_outputs([c[0] for c in chunks], self.client.pad_id), torch.cat([c[3] for c in chunks])

    def stream(self, ids: list, seeds: list, sampling: SamplingParams, key):
        """(output, lo, hi, row versions) per chunk of this rank's prompts [lo, hi), in completion order:
        held or in flight for `key`, else asked for now with the newest weights."""
        if key in self.held:
            yield from self.held.pop(key)
            return
        restored = self._restored(key) if self.restored is not None else None
        if restored is not None:
            yield from restored
            return
        if self.owed_key != key:
            self.drain()
            self._flush_deferred()
            self.client.submit(ids, seeds, sampling, key)
        self.owed_key = None
        yield from self.client.receive()

    def prefetch(self, ids: list, seeds: list, sampling: SamplingParams, key) -> None:
        """s = 1: weights of the last update out, then the next batch in flight; s = 0: nothing."""
        if self.staleness == 0:
            return
        self.drain()
        self._flush_deferred()
        self.client.submit(ids, seeds, sampling, key)
        self.owed_key = key

    def updated(self, model, version: int, now: bool = False, onload=None) -> dict:
        """New weights after an update: sent now (s = 0, or `now`), else when the batch in flight is in;
        with partial rollout, into the generation in flight when it is still running. `onload()` puts the
        parameters back on the device right before they are read: a deferred send comes after other
        phases (reward model, reference, a streamed pass), which may have offloaded them (storage freed)."""
        self.pending = (model, version, onload)
        if now or self.staleness == 0 or self.owed_key is None:
            return self.flush()
        if self.partial and self.client.claim_generation():
            self.pending = None
            _onload(onload)
            return self.client.send_weights(model, version)
        return {}

    def flush(self) -> dict:
        if self.pending is None:
            return {}
        self.drain()
        model, version, onload = self.pending
        self.pending = None
        _onload(onload)
        return self.client.sync(model, version)

    def _flush_deferred(self) -> None:
        """Send weights that waited for the batch in flight; their figures (perf/weight_sync_s, ..._buckets)
        are booked with their bytes, under the step of their update (split_perf's late figures)."""
        if self.pending is not None:
            version = self.pending[1]
            report = self.flush()  # books the bytes under the version
            self.client.sync_bytes[version].update(report)

    def drain(self) -> None:
        """Receive the answer in flight (kept for its step)."""
        if self.owed_key is not None:
            key, self.owed_key = self.owed_key, None
            self.held[key] = list(self.client.receive())
            self.saved_answer = (key, *self.client.answer)

    def in_flight(self) -> dict | None:
        """The next step's batch, generated and not yet trained (received first if still in flight), as a
        checkpoint keeps it: whole answer messages and the global prompt order, valid at any DP layout."""
        self.drain()
        if self.saved_answer is None or self.saved_answer[0] not in self.held:
            return None
        key, indices, messages = self.saved_answer
        parts = [None] * self.client.groups.dp
        dist.all_gather_object(parts, messages, group=self.client.groups.dp_group)
        return {"step": key[0], "indices": indices, "messages": merge_messages(parts, self.client.pad_id)}

    def restore(self, state: dict) -> None:
        """Hold a checkpoint's in-flight batch for its step; each rank takes the rows of its own prompts."""
        self.restored = state

    def _restored(self, key):
        """This rank's chunks of a restored in-flight batch, when `key` asks for it (else None)."""
        state, self.restored = self.restored, None
        if state is None or state["step"] != key[0]:
            return None
        mine = list(key[1])
        where = {i: p for p, i in enumerate(state["indices"])}
        lo = where[mine[0]] if mine else 0
        if [where.get(i) for i in mine] != list(range(lo, lo + len(mine))):
            raise RuntimeError(f"the saved in-flight batch of step {state['step']} holds other prompts than the "
                               "data loader gives this rank; resume with the same data.* settings")
        return [c for msg in state["messages"] for c in my_rows(msg, lo, lo + len(mine))]

    def stop(self) -> None:
        """Release the rollout ranks (once; the answer in flight is received first)."""
        if self.client.control is None or self.client.lost:
            return
        self.drain()
        self.client.stop()
        self.client.control = None


def _onload(onload) -> None:
    if onload is not None:
        onload()
