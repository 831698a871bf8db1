"""Which rank died: heartbeats in the job's TCPStore, read after a collective broke.

A collective whose peer process died fails on the survivors (gloo: the connection closed at once; nccl:
at the process-group timeout, `trainer.dist_timeout_s`) with an error that names an address, not a
rank. Every rank stamps `heartbeat/<rank>` in the default store once a second from a daemon thread; after
such a failure a survivor reads the stamps twice, `probe_s` apart, and the ranks whose stamp did not move
are the dead ones. The store lives in the launcher's agent (torchrun) or in rank 0: when it is gone the
answer is "unknown" rather than a guess.
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


class Heartbeats:
    def __init__(self, period_s: float = 1.0):
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
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

    def _stamps(self) -> dict:
        out = {}
        for r in range(self.world):
            if r != self.rank:
                try:
                    out[r] = self.store.get(f"heartbeat/{r}")
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
