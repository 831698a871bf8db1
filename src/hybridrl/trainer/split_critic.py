"""Split placement with a critic of its own (`placement.critic_world_size` c > 0).

The c ranks just before the rollout ranks hold the critic at `critic.tensor_model_parallel_size` /
`pipeline_model_parallel_size` in a megatron-core world of their own. The trainers' rank 0 talks to
them over the `critic` bridge: `values` (a forward over the step's batch) and `update` (the clipped
value-loss update) carry the batch columns the critic needs, once per step (`update` adds only the returns
to what `values` brought; token ids int32, masks bool). Rank 0 gathers them over the trainers' DP and sends
each critic rank only the rows of its critic DP group (serialized once per group; TP/PP peers get the same),
and the critic's first rank answers with the values gathered over the critic's DP or the update's metrics. With
`trainer.timeline_dir` set every critic rank records its phases (`values`, `update_critic`, `save`, `load`,
`wait_request`) and the answers carry them to the trainers' timeline.json. A request
is sent before the actor's own work and answered after it, so the critic's values pass overlaps the
actor's log-prob passes and the two updates run at the same time. `save` / `load` write and read the
critic's part of a checkpoint folder with dist_checkpointing over the critic ranks.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

from hybridrl.config import Config
from hybridrl.parallel import liveness
from hybridrl.parallel.split_world import Bridge, SplitWorld
from hybridrl.trainer.split import spans_to_leader, talking_to
from hybridrl.trainer.rollout_rows import tensor_bytes
from hybridrl.trainer.step_batch import dp_rows, gather_dp, local_slice

VALUE_KEYS = ("input_ids", "attention_mask", "response_mask")
UPDATE_KEYS = VALUE_KEYS + ("values", "returns")
MASKS = ("attention_mask", "response_mask")


def _wire(key: str, t: torch.Tensor):
    """(column as it crosses: ids int32, 0/1 masks bool, others as they are; its dtype on arrival)."""
    small = t.int() if key == "input_ids" else t.bool() if key in MASKS else t
    return small, t.dtype


def critic_bridge(world: SplitWorld) -> Bridge | None:
    if world.role == "rollout" or (world.role == "train" and world.rank != 0):
        return None
    with talking_to(*_other_role(world), "start-up"):
        return Bridge(world, "critic", [0] + world.ranks_of("critic"))


def _other_role(world: SplitWorld) -> tuple:
    """(role, ranks) at the other end of the critic bridge."""
    return ("trainer", [0]) if world.role == "critic" else ("critic", world.ranks_of("critic"))


class RemoteCritic:
    """The trainers' handle on the critic ranks, with CriticWorker's `compute_values` / `update_critic`;
    every trainer rank calls every method."""

    def __init__(self, world: SplitWorld, groups, hf_folder: str, total_steps: int):
        self.world, self.groups = world, groups
        self.bridge = critic_bridge(world)
        self.leader = world.ranks_of("critic")[0]
        self.on_wait = None
        """Called as on_wait(start, end) (perf_counter seconds) around each exchange with the critic ranks."""
        self.rows_bytes = 0
        """Bytes of batch columns the critic ranks received from this rank (perf/rows_bytes): each critic rank
        its critic DP group's rows."""
        self.sent = self.sent_mask = None
        """The batch whose columns the critic ranks hold (from its `values` request)."""
        self.answers = 0
        self.spans = []
        """The critic ranks' (global rank, phase, start, end) spans so far, on trainer rank 0 (timeline.json)."""
        self.dp_of = {}
        """Critic global rank -> its critic DP rank (on trainer rank 0): which rows each critic rank receives."""
        if self.bridge is not None:
            with talking_to("critic", world.ranks_of("critic"), "start-up"):
                self.bridge.broadcast_object({"kind": "hello", "folder": hf_folder, "total_steps": total_steps}, 0)
                self.dp_of = self.bridge.broadcast_object(None, self.leader)

    def _waited(self, start: float) -> None:
        if self.on_wait is not None:
            self.on_wait(start, time.perf_counter())

    def _send(self, msg) -> None:
        """`msg` to every critic rank, its `batch` columns (gathered over the trainers' DP) cut to the rows of
        the rank's critic DP group."""
        if self.bridge is None:
            return
        ranks_in = Counter(self.dp_of.values())  # critic DP rank -> how many critic ranks receive its rows
        parts = [(d, _rows_of(msg, len(ranks_in), d)) for d in range(len(ranks_in))]
        self.rows_bytes += sum(tensor_bytes(part.get("batch", {})) * ranks_in[d] for d, part in parts)
        with talking_to("critic", self.world.ranks_of("critic"), f"the {msg['kind']} request"):
            self.bridge.send_to_groups(parts, self.dp_of)

    def _answer(self):
        """The critic leader's answer, on every trainer rank: the others wait for rank 0 to have it on a store
        key (as long as the critic ranks and rank 0 beat), not in a collective that would time out."""
        start, key = time.perf_counter(), f"critic/answer/{self.answers}"
        self.answers += 1
        with talking_to("critic", self.world.ranks_of("critic"), "a wait for the critic"):
            box = [self.bridge.broadcast_object(None, self.leader) if self.bridge is not None else None]
            if self.bridge is not None:
                self.world.store.set(key, "1")
                if self.answers > 1:
                    self.world.store.delete_key(f"critic/answer/{self.answers - 2}")
            else:
                liveness.wait_key(self.world.store, key, [0] + self.world.ranks_of("critic"))
        dist.broadcast_object_list(box, src=0)
        self._waited(start)
        answer, spans = box[0]
        if self.bridge is not None:
            self.spans += spans
        return answer

    def _request(self, kind: str, batch, keys, **more) -> None:
        start = time.perf_counter()
        columns = {k: _wire(k, gather_dp(batch[k], self.groups).cpu()) for k in keys}
        self._send({"kind": kind, "batch": columns, **more})
        self._waited(start)

    def request_values(self, batch) -> None:
        self.sent, self.sent_mask = batch, batch["response_mask"]
        self._request("values", batch, VALUE_KEYS)

    def values(self) -> torch.Tensor:
        return local_slice(self._answer(), self.groups).to(self.groups.device)

    def compute_values(self, batch, batching=None) -> torch.Tensor:
        self.request_values(batch)
        return self.values()

    def request_update(self, batch, apply: bool = True) -> None:
        """The critic ranks still hold the columns and values of this batch's `values` request: returns only, and
        the response mask again where rejection sampling replaced it since."""
        held = batch is self.sent
        keys = (("returns",) if batch["response_mask"] is self.sent_mask else ("returns", "response_mask")) \
            if held else UPDATE_KEYS
        self.sent = self.sent_mask = None
        self._request("update", batch, keys, apply=apply, held=held)

    def update_metrics(self) -> dict:
        return self._answer()

    def update_critic(self, batch, mini_batch_rows=None, batching=None, apply: bool = True) -> dict:
        self.request_update(batch, apply)
        return self.update_metrics()

    def save(self, folder: str) -> None:
        self._send({"kind": "save", "folder": folder})
        self._answer()

    def load(self, folder: str) -> None:
        self._send({"kind": "load", "folder": folder})
        error = self._answer()
        if error:
            from hybridrl.checkpoint import CheckpointError

            raise CheckpointError(error)

    def stop(self) -> None:
        self._send({"kind": "stop"})


def _rows_of(msg: dict, dp: int, dp_rank: int) -> dict:
    """`msg` with only critic DP rank `dp_rank`'s rows of its batch columns (as it is when it has none)."""
    if "batch" not in msg:
        return msg
    return dict(msg, batch={k: (dp_rows(v, dp, dp_rank), dtype) for k, (v, dtype) in msg["batch"].items()})


def serve_critic(cfg: Config, world: SplitWorld) -> int:
    """The loop of a critic rank: build the critic at its own TP/PP, then answer until `stop`."""
    from hybridrl.config.batching import resolve_batching
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.timeline import Timeline
    from hybridrl.trainer.roles import build_critic_worker

    bridge = critic_bridge(world)
    torch.manual_seed(cfg.trainer.seed)
    groups = init_model_parallel(cfg.critic.tensor_model_parallel_size, cfg.critic.pipeline_model_parallel_size,
                                 seed=cfg.trainer.seed)
    with talking_to("trainer", [0], "start-up"):
        hello = bridge.broadcast_object(None, 0)
        dp_of = [None] * dist.get_world_size()
        dist.all_gather_object(dp_of, groups.dp_rank)
        bridge.broadcast_object(dict(zip(world.ranks_of("critic"), dp_of)), world.ranks_of("critic")[0])
    mini_batch_samples = cfg.critic.ppo_mini_batch_size * cfg.rollout.n
    worker = build_critic_worker(cfg, groups, hello["folder"], hello["total_steps"])
    batching = resolve_batching(cfg)
    lead = world.rank == world.ranks_of("critic")[0]
    held = {}  # the columns and values of the last `values` request, for the update that follows it
    timeline = Timeline(world.rank, "critic", bool(cfg.trainer.timeline_dir))
    while True:
        with talking_to("trainer", [0], "the wait for a request"), timeline.span("wait_request"):
            msg = bridge.recv_object(0)
        kind = msg["kind"]
        if kind == "stop":
            return 0
        with timeline.span({"update": "update_critic"}.get(kind, kind)):
            answer = _serve(msg, worker, groups, held, batching, mini_batch_samples)
        spans = _gather_spans(timeline)
        with talking_to("trainer", [0], f"the answer to {kind}"):
            bridge.broadcast_object((answer, spans) if lead else None, world.ranks_of("critic")[0])


def _gather_spans(timeline) -> list:
    """Every critic rank's spans since the last answer, as (global rank, phase, start, end), on the critic's
    first rank (collective over the critic ranks when the timeline is on; [] when it is off)."""
    if not timeline.enabled:
        return []
    return spans_to_leader(timeline) or []


def _serve(msg, worker, groups, held: dict, batching, mini_batch_samples: int):
    """The answer to one request (`held` keeps a `values` request's columns for the update after it)."""
    from hybridrl.checkpoint import CheckpointError
    from hybridrl.checkpoint.sharded import load_role, save_role

    kind, answer = msg["kind"], None
    if kind in ("values", "update"):
        batch = {k: v.to(groups.device, dtype) for k, (v, dtype) in msg["batch"].items()}  # this DP group's rows
        if kind == "values":
            held.clear()
            held.update(batch, values=worker.compute_values(batch, batching.critic_values))
            answer = gather_dp(held["values"], groups).cpu()
        else:
            batch = {**held, **batch} if msg["held"] else batch
            held.clear()
            answer = worker.update_critic(batch, mini_batch_samples // groups.dp,
                                          batching.critic_update, apply=msg["apply"])
    elif kind == "save":
        save_role(worker, msg["folder"], False)
    elif kind == "load":
        try:
            load_role(worker, msg["folder"], "critic")
        except CheckpointError as err:
            answer = str(err)
    return answer
