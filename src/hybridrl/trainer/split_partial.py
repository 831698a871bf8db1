"""Partial rollout on the rollout ranks of split placement: new weights taken between two decode steps."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


PARTIAL_KEY = "partial_rollout/state"
"""Store key of the partial-rollout handshake: "queued" (the trainers asked for an answer), "generating" (it is
in the works), "weights" (the trainers are sending new weights: take them at the next decode step) or "done"
(generation finished). The trainers may claim a queued answer: when they are quicker than the rollout ranks
are to begin it, the weights go into that answer instead of waiting for the one after it."""


def queue_answer(store) -> None:
    """The trainers' side, as they send a generate request."""
    store.set(PARTIAL_KEY, "queued")


def claim_answer(store) -> bool:
    """The trainers' side, with new weights: whether the answer asked for is still to come (queued, or being
    generated), in which case the rollout ranks take the weights at their next poll and the trainers send them now."""
    return any(store.compare_set(PARTIAL_KEY, state, "weights") == b"weights" for state in ("queued", "generating"))


class _PartialWeights:
    """Partial rollout on the rollout ranks (one engine replica): every `poll_steps` decode steps the
    replica's first rank looks at the handshake key, every rank of the replica agrees, and new weights are
    taken in place; generation goes on with them. The trainers only send into an answer after switching the
    key from "queued" or "generating" to "weights" (compare-and-set, `claim_answer`), and the replica ends an
    answer by switching it to "done" the same way, so a weight send is never left without a receiver. The
    agreement is a broadcast on the rollout world (nccl on GPUs: its flag lives on `device`); a store read is
    a TCP round trip, hence not at every step."""

    def __init__(self, store, receiver, engine, leader: bool, device, timeline=None, poll_steps: int = 4):
        self.store, self.receiver, self.engine, self.leader, self.timeline = store, receiver, engine, leader, timeline
        self.device, self.poll_steps, self.steps = device, poll_steps, 0
        self.version = -1

    def _agree(self, value: bool) -> bool:
        """The leader's `value` on every rank of the replica."""
        if dist.get_world_size() == 1:
            return value
        flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def begin(self) -> None:
        self.steps = 0
        if self.leader:  # weights claimed while queued stay announced: the first poll takes them
            self.store.compare_set(PARTIAL_KEY, "queued", "generating")

    def between_steps(self) -> bool:
        self.steps += 1
        if self.steps % self.poll_steps:
            return False
        if not self._agree(self.leader and self._weights_announced()):
            return False
        self._receive()
        if self.leader:
            self.store.set(PARTIAL_KEY, "generating")
        return True

    def _weights_announced(self) -> bool:
        return self.store.get(PARTIAL_KEY) == b"weights"

    def _receive(self) -> None:
        with self.timeline.span("update_weights") if self.timeline else contextlib.nullcontext():  # inside `gen`
            self.version = self.receiver.receive(self.engine)

    def end(self) -> None:
        """Generation of the answer is over: close the window, or take weights already on their way."""
        sent = self.leader and self.store.compare_set(PARTIAL_KEY, "generating", "done") == b"weights"
        if self._agree(sent):
            self._receive()
            if self.leader:
                self.store.set(PARTIAL_KEY, "done")
