"""Waits between split placement's roles: idle for longer than `trainer.dist_timeout_s` while the peers beat,
ended by a silent peer's heartbeats with hybridrl's own `rank R died` line; and two broadcasts in flight on one
bridge (a weight sender's double buffering)."""
import os
import signal
import time
from datetime import timedelta

import pytest

from dist_helper import free_port, run_distributed

TIMEOUT_S = 2


def _bridge(port: int):
    """Both ranks on a store of their own (rank 0 hosts it), beating, and a 2-member bridge at a 2 s timeout."""
    import torch.distributed as dist

    from hybridrl.parallel import liveness
    from hybridrl.parallel.split_world import Bridge, SplitWorld

    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=TIMEOUT_S))
    liveness.start(store, rank, 2, TIMEOUT_S)
    world = SplitWorld(rank, 2, 1, store, timedelta(seconds=TIMEOUT_S))
    return rank, Bridge(world, "test", [0, 1])


def _long_idle_wait(port: int):
    from hybridrl.parallel import liveness

    rank, bridge = _bridge(port)
    try:
        if rank == 0:
            time.sleep(3 * TIMEOUT_S)  # a generation, a checkpoint save: idle for the other side
        return bridge.broadcast_object("the answer" if rank == 0 else None, 0)
    finally:
        liveness.stop()


def test_an_idle_wait_outlasts_the_timeout_while_the_peer_beats():
    """Rank 1 waits 6 s for rank 0 on a bridge whose timeout (dist_timeout_s) is 2 s: it gets the answer."""
    assert run_distributed(_long_idle_wait, 2, free_port()) == ["the answer", "the answer"]


def _two_in_flight(port: int):
    """Rank 0 starts broadcasting two buffers (a weight sender's two buckets) before rank 1, 1.5 s late, posts
    its receives; (seconds rank 0 took to start both, what rank 1 got)."""
    import torch

    from hybridrl.parallel import liveness

    rank, bridge = _bridge(port)
    try:
        buffers = [torch.full((4096,), float(k + 1)) if rank == 0 else torch.zeros(4096) for k in range(2)]
        if rank == 1:
            time.sleep(1.5)
        start = time.monotonic()
        waits = [bridge.start_broadcast(b, 0) for b in buffers]
        started = time.monotonic() - start
        for wait in waits:
            wait()
        return started, [sorted(set(b.tolist())) for b in buffers]
    finally:
        liveness.stop()


def test_two_broadcasts_in_flight_on_one_bridge():
    """`Bridge.start_broadcast` returns at once (the sender gathers its next bucket meanwhile) with two in flight
    on one bridge; both arrive whole and in order once the receiver posts, late."""
    (started, _), (_, got) = run_distributed(_two_in_flight, 2, free_port(), timeout=90)
    assert started < 0.5, started
    assert got == [[1.0], [2.0]]


def _silent_peer(port: int):
    from hybridrl.parallel import liveness
    from hybridrl.trainer.split import PeerLostError, talking_to

    rank, bridge = _bridge(port)
    liveness.DEAD_AFTER_S = 2.0
    if rank == 1:  # alive but silent: no heartbeat, no answer (a hung process looks the same)
        liveness.stop()
        time.sleep(8)
        return None
    start = time.monotonic()
    try:
        with talking_to("rollout", [1], "generation (waiting for responses)"):
            bridge.broadcast_object(None, 1)
    except PeerLostError as err:
        return str(err), time.monotonic() - start
    finally:
        liveness.stop()


def test_a_silent_peer_is_named_by_its_heartbeat():
    """A peer that stops beating ends the wait within seconds (no timeout involved), naming the rank."""
    (message, waited), _ = run_distributed(_silent_peer, 2, free_port(), timeout=90)
    assert message.startswith("rollout rank 1 died or stopped answering during generation (waiting for "
                              "responses) (rank 1 sent no heartbeat for "), message
    assert waited < 8


def _stopped_mid_send(port: int):
    """Rank 1 rings the bell of a 64 MiB message to rank 0 and stops (no heartbeat, no bytes): what SIGSTOP of a
    rollout rank between the bell and the end of its send leaves. Rank 0's receive must end naming it."""
    import torch

    from hybridrl.parallel import liveness
    from hybridrl.trainer.split import PeerLostError, talking_to

    rank, bridge = _bridge(port)
    liveness.DEAD_AFTER_S = 2.0
    if rank == 1:
        bridge.store.set(bridge._bell(1, 0), str(64 << 20))
        liveness.stop()
        time.sleep(11)  # then its exit closes the connection: the only way the receive ended before
        return None
    start = time.monotonic()
    try:
        with talking_to("rollout", [1], "generation (receiving responses)"):
            bridge.recv_object(1)
    except PeerLostError as err:
        return str(err), time.monotonic() - start
    finally:
        liveness.stop()


def test_a_peer_stopped_mid_transfer_is_named_by_its_heartbeat():
    """A gloo recv cannot be polled: it is waited on in a helper thread while the heartbeats are watched (the
    receive hung for good when the sender stopped after ringing its bell: the split liveness test's flake)."""
    (message, waited), _ = run_distributed(_stopped_mid_send, 2, free_port(), timeout=90)
    assert message.startswith("rollout rank 1 died or stopped answering during generation (receiving"), message
    assert waited < 8


@pytest.mark.slow
def test_a_stopped_rollout_rank_ends_the_job_with_its_rank(tmp_path):
    """SIGSTOP of the rollout rank (alive, connections open, silent: what gloo and nccl cannot see): the
    trainer ends non-zero with one `error:` line naming rollout rank 1, from its heartbeats."""
    from test_split_placement import _launch_split, _rollout_pid, _wait_for

    procs, log = _launch_split(tmp_path, "per-rank processes")
    try:
        _wait_for(log, "step:2")
        rollout = _rollout_pid(procs)
        os.kill(rollout, signal.SIGSTOP)
        code = procs[0].wait(timeout=90)
    finally:
        for p in procs:
            p.kill()
    assert code != 0
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout rank 1 died or stopped answering during" in errors[0], errors
    assert "rank 1 sent no heartbeat for" in errors[0], errors
