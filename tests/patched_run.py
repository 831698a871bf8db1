"""scripts/train_ppo.py with test patches, for torchrun (which starts a script, not a function); each is chosen
by an environment variable of its own, and none lives in the package:

SHIFT_ROUTES_ON=1,2   the native engine reports the routes of those generate calls shifted (`shifted_routes`).
STREAM_HOLD_FILE=path streamed steps: a trainer rank creates `path` as it begins the passes on a chunk, and the
                      rollout ranks generate each chunk of their first answer after its first only once it exists
                      (2 min at most), so a pass runs while the step's batch is still being generated, however
                      busy the machine.
PARTIAL_HOLD_STEP=n   partial rollout: decode step n of each answer after the first waits (2 min at most) for the
                      trainers' "weights", so they land mid-generation, however busy the machine.
"""
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD_S = 120.0


def _wait(ready) -> bool:
    """Whether `ready()` came true within HOLD_S (polled: a blocking store wait would hold the connection the
    rank's heartbeats go through)."""
    deadline = time.monotonic() + HOLD_S
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def hold_streamed_chunks(path: str) -> None:
    from hybridrl.rollout.native import NativeEngine
    from hybridrl.trainer import split
    from hybridrl.trainer.ppo import PPOTrainer

    forward_passes, answer, generate = PPOTrainer.forward_passes, split._Server.answer, NativeEngine.generate
    state = {"answers": 0, "calls": 0}

    def announcing(self, *args, **kwargs):
        open(path, "a").close()
        return forward_passes(self, *args, **kwargs)

    def counting(self, *args, **kwargs):
        state["answers"], state["calls"] = state["answers"] + 1, 0
        return answer(self, *args, **kwargs)

    def holding(self, *args, **kwargs):  # inside the chunk's `gen` span, as generation itself
        state["calls"] += 1
        if state["answers"] == 1 and state["calls"] > 1:
            _wait(lambda: os.path.exists(path))
        return generate(self, *args, **kwargs)

    PPOTrainer.forward_passes, split._Server.answer, NativeEngine.generate = announcing, counting, holding


def hold_partial_decode(step: int) -> None:
    from hybridrl.trainer import split_partial as sp

    begin, receive, state = sp._PartialWeights.begin, sp._PartialWeights._receive, {"answers": 0, "took": False}

    def counting(self):
        state["answers"], state["took"] = state["answers"] + 1, False
        return begin(self)

    def marking(self):
        state["took"] = True
        return receive(self)

    def announced(self):
        ready = lambda: self.store.get(sp.PARTIAL_KEY) == b"weights"  # noqa: E731
        if state["answers"] > 1 and step <= self.steps and not state["took"]:
            return _wait(ready)
        return ready()

    sp._PartialWeights.begin, sp._PartialWeights._receive, sp._PartialWeights._weights_announced = \
        counting, marking, announced


if __name__ == "__main__":
    if os.environ.get("SHIFT_ROUTES_ON"):
        from shifted_routes import shift_routes

        shift_routes({int(c) for c in os.environ["SHIFT_ROUTES_ON"].split(",")})
    if os.environ.get("STREAM_HOLD_FILE"):
        hold_streamed_chunks(os.environ["STREAM_HOLD_FILE"])
    if os.environ.get("PARTIAL_HOLD_STEP"):
        hold_partial_decode(int(os.environ["PARTIAL_HOLD_STEP"]))
    script = os.path.join(ROOT, "scripts", "train_ppo.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
