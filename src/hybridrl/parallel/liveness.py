"""Which rank died: heartbeats in the job's TCPStore, read after a collective broke or while a wait lasts.

A collective whose peer process died fails on the survivors (gloo: the connection closed at once; nccl:
at the process-group timeout) with an error that names an address, not a rank. Every rank stamps
`heartbeat/<rank>` in a store once a second from a daemon thread; after such a failure a survivor reads
the stamps twice, `probe_s` apart, and the ranks whose stamp did not move are the dead ones. The store
lives in the launcher's agent (torchrun) or in rank 0: when it is gone the answer is "unknown" rather
than a guess.

Split placement: every rank of every role beats in the job's store from the moment it joins
(`start`), and the waits between roles that are idle by design (a long generation, a checkpoint save,
critic ranks waiting out generation, start-up) poll their peers' stamps (`wait_alive`, `Watch`) instead
of ending at a timeout: a wait with live peers lasts as long as it must, a peer silent for
`DEAD_AFTER_S` ends it with `PeerDied` naming the rank.
"""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "Watchdog caught collective operation timeout", "Socket Timeout")
"""What torch.distributed's backends say when the other side of a collective is gone."""


def is_peer_lost(err: BaseException) -> bool:
    return isinstance(err, (RuntimeError, dist.DistError)) and any(s in str(err) for s in PEER_LOST)


DEAD_AFTER_S = 15.0
"""A peer whose stamp stood still this long (or that never stamped in `never_after_s`) is dead."""


class PeerDied(RuntimeError):
    """Peers of a wait stopped beating; `ranks` names them (global ranks of the job)."""

    def __init__(self, ranks: list, silent_s: float):
        self.ranks = ranks
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        super().__init__(f"{who} sent no heartbeat for {silent_s:.0f} s")


class Heartbeats:
    def __init__(self, period_s: float = 1.0, store=None, rank: int | None = None, world: int | None = None):
        """Beat as `rank` of `world` in `store` (default: the default process group's store and rank)."""
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.period_s, self.count = period_s, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hybridrl-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._done.is_set():
            self.count += 1
            try:
                self.store.set(f"heartbeat/{self.rank}", str(self.count))
            except Exception:  # the store is gone: the job is ending anyway
                return
            self._done.wait(self.period_s)

    def close(self) -> None:
        """Stop beating and wait for the thread. Call before the process exits: a daemon thread caught inside
        the store's C++ call while the interpreter shuts down is ended by pthread_exit, which aborts the
        process ("terminate called without an active exception") after the run has finished."""
        self._done.set()
        self._thread.join(timeout=10)

    def _stamps(self, ranks=None) -> dict:
        """{rank: its last stamp, None where it never stamped or the store cannot be read}."""
        out = {}
        for r in (range(self.world) if ranks is None else ranks):
            if r != self.rank:
                try:
                    key = f"heartbeat/{r}"
                    out[r] = self.store.get(key) if self.store.check([key]) else None
                except Exception:
                    out[r] = None
        return out

    def stopped(self, probe_s: float = 3.0) -> list[int] | None:
        """Ranks whose heartbeat stood still for `probe_s` (None: the store cannot be read)."""
        first = self._stamps()
        if all(v is None for v in first.values()) and first:
            return None
        time.sleep(probe_s)
        second = self._stamps()
        return sorted(r for r in first if first[r] is not None and first[r] == second[r] or second[r] is None)


_BEATING: list = []
"""The heartbeats this process started with `start` (split placement: every role, on the job's store)."""


def start(store, rank: int, world: int, patience_s: float) -> Heartbeats:
    """Beat as `rank` in `store` until `stop()` (once per process); a peer that never beat in `patience_s`
    (`trainer.dist_timeout_s`) did not start."""
    if not _BEATING:
        _BEATING.append(Heartbeats(store=store, rank=rank, world=world))
        _BEATING[0].patience_s = patience_s
    return _BEATING[0]


def stop() -> None:
    if _BEATING:
        _BEATING.pop().close()


def beating() -> Heartbeats | None:
    return _BEATING[0] if _BEATING else None


class Watch:
    """The stamps of `peers` while a wait lasts: `check()` raises PeerDied for those that stood still for
    `dead_after_s`, or never stamped in `never_after_s` (a rank that did not start)."""

    def __init__(self, beats: Heartbeats, peers, dead_after_s: float | None = None):
        self.beats, self.peers = beats, [p for p in peers if p != beats.rank]
        self.dead_after_s = DEAD_AFTER_S if dead_after_s is None else dead_after_s
        self.never_after_s = getattr(beats, "patience_s", 600.0)
        now = time.monotonic()
        self.seen = {r: (stamp, now) for r, stamp in beats._stamps(self.peers).items()}

    def check(self) -> None:
        now, dead = time.monotonic(), []
        for r, stamp in self.beats._stamps(self.peers).items():
            last, since = self.seen[r]
            if stamp != last:
                self.seen[r] = (stamp, now)
            elif now - since > (self.dead_after_s if stamp is not None else self.never_after_s):
                dead.append(r)
        if dead:
            raise PeerDied(dead, max(now - self.seen[r][1] for r in dead))


def wait_alive(work, peers, check_s: float = 1.0) -> None:
    """`work.wait()` of an op with `peers` (global ranks) that may idle for long: polls the op and, every
    `check_s`, the peers' heartbeats; without heartbeats (`start` not called) a plain wait."""
    beats = beating()
    if beats is None:
        work.wait()
        return
    _poll(work.is_completed, beats, peers, check_s)
    work.wait()  # raises the op's own error, if any


def wait_until(done, peers, check_s: float = 1.0) -> None:
    """Until `done()`, for as long as `peers` beat (PeerDied when one stops); call only with heartbeats on."""
    _poll(done, beating(), peers, check_s)


def wait_key(store, key: str, peers, check_s: float = 1.0) -> None:
    """Wait until `key` is in `store`, for as long as `peers` beat (a plain `store.wait` without heartbeats)."""
    beats = beating()
    if beats is None:
        store.wait([key])
        return
    _poll(lambda: store.check([key]), beats, peers, check_s)


def _poll(done, beats: Heartbeats, peers, check_s: float) -> None:
    watch, nap, checked = None, 1e-4, time.monotonic()
    while not done():
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
        if time.monotonic() - checked > check_s:
            watch = watch or Watch(beats, peers)
            watch.check()
            checked = time.monotonic()
