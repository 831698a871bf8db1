"""Partial rollout's handshake between the trainers and one rollout replica, on a real TCPStore: weights
the trainers claim for an answer reach it whether the claim comes before the replica begins the answer,
while it generates, or not at all once it is over (then they wait for the next request)."""
from dist_helper import run_distributed


class _Receiver:
    """Stands for the weight bridges: counts the weights taken, gives them version 1, 2, ..."""

    def __init__(self):
        self.taken = 0

    def receive(self, engine):
        self.taken += 1
        return self.taken


def _answer(partial, decode_steps: int) -> list:
    """The rollout replica generating one answer: the decode steps at which it took weights (0: at its end)."""
    partial.begin()
    took = [step for step in range(1, decode_steps + 1) if partial.between_steps()]
    before = partial.receiver.taken
    partial.end()
    return took + [0] * (partial.receiver.taken - before)


def _handshake():
    import torch.distributed as dist

    from hybridrl.trainer.split_partial import PARTIAL_KEY, _PartialWeights, claim_answer, queue_answer

    store = dist.distributed_c10d._get_default_store()
    partial = _PartialWeights(store, _Receiver(), None, True, "cpu")
    seen = {}
    queue_answer(store)  # the trainers ask, then finish their update before the replica begins: claimed queued
    seen["queued_claim"] = claim_answer(store)
    seen["queued_took"] = _answer(partial, 10)
    seen["after_end_claim"] = claim_answer(store)  # the answer is over: these weights wait for the next request
    queue_answer(store)
    partial.begin()
    took = [s for s in range(1, 6) if partial.between_steps()]
    seen["generating_claim"] = claim_answer(store)  # mid-answer, after decode step 5
    took += [s for s in range(6, 11) if partial.between_steps()]
    partial.end()
    seen["generating_took"] = took
    queue_answer(store)  # an answer shorter than one poll: weights claimed while queued are taken at its end
    seen["short_claim"] = claim_answer(store)
    seen["short_took"] = _answer(partial, 2)
    seen["state"] = store.get(PARTIAL_KEY).decode()
    seen["taken"], seen["version"] = partial.receiver.taken, partial.version
    return seen


def test_weights_claimed_before_during_and_after_an_answer():
    seen = run_distributed(_handshake, 1, timeout=120)[0]
    assert seen["queued_claim"] and seen["queued_took"] == [4]  # the first poll takes them
    assert not seen["after_end_claim"]
    assert seen["generating_claim"] and seen["generating_took"] == [8]
    assert seen["short_claim"] and seen["short_took"] == [0]
    assert seen["state"] == "done" and seen["taken"] == 3 and seen["version"] == 3
