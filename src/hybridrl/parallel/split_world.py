"""Split placement inside one torchrun job: each role gets a torch.distributed world of its own.

megatron-core's parallel_state builds its groups over the whole default world, so the trainers cannot
share one with ranks that only generate. Instead every process joins one TCPStore (the launcher's
MASTER_ADDR:MASTER_PORT, hosted by global rank 0) and initialises its default process group over its
role's ranks only, under a role prefix of that store: on a trainer `dist.get_world_size()` is the
trainer count and megatron-core works unchanged; on a rollout rank the native engine builds its TP
groups over the rollout ranks. Traffic between roles goes over `Bridge` groups built straight on the
store (`ProcessGroupGloo` / `ProcessGroupNCCL`): only their members create them, no collective over
the whole job is needed, and each bridge has its own fixed message order.

This module only creates groups and moves bytes; it knows nothing of models, engines or batches.
"""
from __future__ import annotations

import dataclasses
import io
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridrl.parallel import liveness

TRAIN, CRITIC, ROLLOUT = "train", "critic", "rollout"


@dataclass(frozen=True)
class SplitWorld:
    rank: int
    """Global rank in the job."""
    world_size: int
    rollout_world_size: int
    store: object
    timeout: timedelta
    critic_world_size: int = 0
    """Ranks of a critic of its own, just before the rollout ranks (0: the critic trains with the actor)."""

    @property
    def train_world_size(self) -> int:
        return self.world_size - self.rollout_world_size - self.critic_world_size

    def ranks_of(self, role: str) -> list[int]:
        first = {TRAIN: 0, CRITIC: self.train_world_size,
                 ROLLOUT: self.train_world_size + self.critic_world_size}[role]
        size = {TRAIN: self.train_world_size, CRITIC: self.critic_world_size, ROLLOUT: self.rollout_world_size}[role]
        return list(range(first, first + size))

    @property
    def role(self) -> str:
        return next(r for r in (TRAIN, CRITIC, ROLLOUT) if self.rank in self.ranks_of(r))

    @property
    def rollout_ranks(self) -> list[int]:
        return self.ranks_of(ROLLOUT)

    @property
    def rollout_leader(self) -> int:
        return self.rollout_ranks[0]


def init_split_world(le, rollout_world_size: int, timeout_s: int = 600, critic_world_size: int = 0) -> SplitWorld:
    """Join the job's store and start this rank's role world as the default process group."""
    from hybridrl.parallel import cpu_compat
    from hybridrl.parallel.distributed import die_with_parent, export_launch_env

    die_with_parent()
    export_launch_env(le)
    cpu_compat.apply()
    timeout = timedelta(seconds=timeout_s)
    # under torchrun its agent already hosts the store on MASTER_PORT: rank 0 only connects (binding again
    # failed, and c10d logged an [E] line at every start)
    host = le.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(le.master_addr, le.master_port, le.world_size, host, timeout)
    liveness.start(store, le.rank, le.world_size, timeout_s)  # every role beats from now on
    world = SplitWorld(le.rank, le.world_size, rollout_world_size, store, timeout, critic_world_size)
    mine = world.ranks_of(world.role)
    first, size = mine[0], len(mine)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(le.local_rank)
    dist.init_process_group(backend, store=dist.PrefixStore(f"role/{world.role}", store),
                            rank=le.rank - first, world_size=size, timeout=timeout)
    return world


IDLE_TIMEOUT = timedelta(days=7)
"""A bridge's op timeout: waits between roles may be idle for long by design (a generation, a checkpoint
save); a dead member is found by its heartbeats (`liveness.wait_alive`), not by a timeout."""


class Bridge:
    """A process group over some global ranks of the job (`members`, in that order), outside the role
    worlds. Every member must make the same calls in the same order; `src` is a global rank. Every wait
    (start-up included: the group is built once all members arrived) lasts as long as the other members
    beat, and ends with `liveness.PeerDied` when one stops."""

    def __init__(self, world: SplitWorld, name: str, members: list[int], backend: str = "gloo"):
        self.members = list(members)
        self.index = {g: i for i, g in enumerate(self.members)}
        self.device = torch.device("cpu")
        store = dist.PrefixStore(f"bridge/{name}", world.store)
        me = self.index[world.rank]
        store.set(f"here/{me}", "1")
        for i in range(len(self.members)):
            liveness.wait_key(store, f"here/{i}", self.members)
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = IDLE_TIMEOUT  # (its default ignored trainer.dist_timeout_s, and idle waits hit it)
            self.pg = dist.ProcessGroupNCCL(store, me, len(self.members), opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, me, len(self.members), IDLE_TIMEOUT)
        self.rank, self.store, self.messages = world.rank, store, {}

    def _wait(self, work) -> None:
        liveness.wait_alive(work, self.members)

    @staticmethod
    def _wait_point_to_point(work, peer: int) -> None:
        """`work.wait()` of a gloo send or recv, whose is_completed stays False until it is waited on: waited on in
        a helper thread while this one watches `peer`'s heartbeats, so a peer stopped mid-transfer (its bell
        rung, its bytes not all sent) ends the wait with PeerDied instead of hanging it."""
        if liveness.beating() is None:
            work.wait()
            return
        done, failed = threading.Event(), []

        def wait():
            try:
                work.wait()
            except BaseException as err:  # noqa: BLE001 - raised again on the calling thread
                failed.append(err)
            finally:
                done.set()

        threading.Thread(target=wait, name="bridge-transfer", daemon=True).start()
        liveness.wait_until(done.is_set, [peer])
        if failed:
            raise failed[0]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.start_broadcast(tensor, src)()
        return tensor

    def start_broadcast(self, tensor: torch.Tensor, src: int):
        """Start broadcasting `tensor` from `src`; returns the call that waits for its end (`tensor` must not
        be read or written before it returns). Several may be in flight; every member starts them in one order."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.index[src]
        work = self.pg.broadcast([tensor], opts)
        return lambda: self._wait(work)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self._wait(self.pg.allreduce([tensor]))
        return tensor

    def broadcast_object(self, obj, src: int):
        """`obj` (anything torch.save takes, tensors on the host) from `src` to every member."""
        payload = serialize(obj) if self.rank == src else None
        size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
        self._host_broadcast(size, src)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._host_broadcast(payload, src)
        return obj if self.rank == src else _deserialize(payload)

    def send_object(self, payload: torch.Tensor, dst: int) -> None:
        """Bytes from `serialize` to the member `dst` only (it calls `recv_object`); host groups (gloo).
        A store key announces each message and its size: the receiver waits on it, polling the sender's
        heartbeats, then receives bytes already on their way (both ends watching the other's heartbeats)."""
        key = self._bell(self.rank, dst)
        self.store.set(key, str(payload.numel()))
        self._wait_point_to_point(self.pg.send([payload], self.index[dst], 0), dst)

    def send_to_groups(self, parts, group_of: dict) -> None:
        """`parts`: (group, obj) pairs; each obj is serialized once and sent to every member r with
        group_of[r] == group (each calls `recv_object`)."""
        for group, obj in parts:
            payload = serialize(obj)
            for rank in (r for r, g in group_of.items() if g == group):
                self.send_object(payload, rank)

    def recv_object(self, src: int):
        key = self._bell(src, self.rank)
        liveness.wait_key(self.store, key, [src])
        payload = torch.empty(int(self.store.get(key)), dtype=torch.uint8)
        self.store.delete_key(key)
        self._wait_point_to_point(self.pg.recv([payload], self.index[src], 0), src)
        return _deserialize(payload)

    def _bell(self, src: int, dst: int) -> str:
        """The store key of the next message from `src` to `dst` (both count the messages of the pair)."""
        n = self.messages.get((src, dst), 0)
        self.messages[(src, dst)] = n + 1
        return f"bell/{src}-{dst}/{n}"

    def _host_broadcast(self, t: torch.Tensor, src: int) -> None:
        if self.device.type == "cpu":
            self.broadcast(t, src)
            return
        on_device = t.to(self.device)
        self.broadcast(on_device, src)
        t.copy_(on_device.cpu())


def serialize(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(_own_storage(obj), buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _deserialize(payload: torch.Tensor):
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def _own_storage(obj):
    """`obj` with each tensor that views a larger storage (a DP group's rows of a batch) copied out: torch.save
    writes a view's whole storage, so the rows of every group would cross each time. Walks dicts, lists,
    tuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.untyped_storage().nbytes() > obj.numel() * obj.element_size() else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _own_storage(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _own_storage(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_own_storage(x) for x in obj)
    return obj
