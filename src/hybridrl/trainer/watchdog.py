"""A per-rank hang watchdog: a run that makes no progress inside one phase ends, and says where.

Every stage the step timer opens (`gen`, `reward`, `old_log_prob`, `update_actor`, ...) and every step
boundary counts as progress. When one phase has run for `trainer.hang_timeout_s` the watchdog thread
writes every thread's Python stack (faulthandler) to `<log dir>/hang_rank<R>.txt`, prints one `error:`
line naming the rank and the phase, and ends the process (exit code EXIT_HANG), so a launcher sees a
failure instead of a job that sits until its time limit. A collective waiting on a dead rank ends
earlier, at `trainer.dist_timeout_s`.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_HANG = 3


class Watchdog:
    def __init__(self, timeout_s: float, log_dir: str, rank: int):
        self.timeout_s, self.log_dir, self.rank = timeout_s, log_dir, rank
        self.phase, self.since = "start-up", time.monotonic()
        self.failed_in: str | None = None
        """The innermost phase an exception left, since the step began (the phase a dead peer broke)."""
        self._stack: list = []
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="hybridrl-watchdog", daemon=True).start()

    def enter(self, phase: str) -> None:
        self._stack.append(self.phase)
        self.phase, self.since = phase, time.monotonic()

    def leave(self, failed: bool = False) -> None:
        if failed and self.failed_in is None:  # unwinding starts in the innermost phase
            self.failed_in = self.phase
        self.phase, self.since = (self._stack.pop() if self._stack else "between steps"), time.monotonic()

    def step(self, step: int) -> None:
        self._stack.clear()
        self.failed_in = None
        self.phase, self.since = f"step {step}", time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(5.0, self.timeout_s / 4))
            stuck = time.monotonic() - self.since
            if stuck >= self.timeout_s:
                self._end(self.phase, stuck)

    def _end(self, phase: str, stuck: float) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, f"hang_rank{self.rank}.txt")
        with open(path, "w") as f:
            f.write(f"rank {self.rank}: no progress for {stuck:.0f} s in phase {phase}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"error: rank {self.rank} made no progress for {stuck:.0f} s in phase {phase} (trainer.hang_timeout_s="
              f"{self.timeout_s:g}); every thread's stack is in {path}", file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)
