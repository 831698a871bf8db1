"""Stopping a run on purpose, in one piece: preemption signals, a stop file and a time limit.

SIGTERM and SIGUSR1 (what SLURM sends before a preemption or the time limit, `--signal=B:USR1@T`),
SIGINT (Ctrl-C), a stop file (`<trainer.default_local_dir>/STOP`, what slurm/ppo.sh touches when its
batch shell gets the signal: no launcher has to forward anything) and `trainer.max_runtime` only raise a
flag. At the next step boundary every trainer rank agrees on it (one all-reduce), the run saves a
checkpoint (with the batch in flight, in split placement), prints `saved on signal at step K`, leaves
`<trainer.default_local_dir>/STOPPED` and exits with EXIT_PREEMPTED, so a job script can requeue and the
requeued job resumes by itself (torchrun exits 1 whatever its ranks' codes: the file is what a job script
can rely on). A second SIGINT stops at once.
"""
from __future__ import annotations

import os
import re
import signal
import time

import torch
import torch.distributed as dist

from hybridrl.checkpoint.folders import META
from hybridrl.log import print0

EXIT_PREEMPTED = 75
"""Exit code of a run that saved and stopped early (BSD's EX_TEMPFAIL: try again later)."""
STOP_FILE = "STOP"
STOPPED_FILE = "STOPPED"
"""Left beside the stop file by a run that saved and stopped early: "step K (reason)"."""


def saves_at(step: int, total: int, save_freq: int, stopping: str) -> bool:
    """Whether a run checkpoints after `step`: every save_freq steps and at its last (save_freq > 0), or to stop."""
    return bool(stopping) or (save_freq > 0 and (step % save_freq == 0 or step == total))


def parse_runtime(text: str) -> float:
    """Seconds of "HH:MM:SS" (or "D-HH:MM:SS", "MM:SS"); 0 for an empty string."""
    if not text:
        return 0.0
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not m:
        raise ValueError(f"trainer.max_runtime={text!r} is not HH:MM:SS (or D-HH:MM:SS)")
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def deadline(max_runtime: str, margin_s: float, environ=None) -> float | None:
    """Epoch seconds after which the run saves and stops: trainer.max_runtime from the process's start (its
    set-up, checkpoint load and first validation count, as in Megatron-LM's exit duration), or SLURM's job end
    time (SLURM_JOB_END_TIME) less `margin_s` (time to save), whichever comes first; None without either."""
    import psutil

    env = os.environ if environ is None else environ
    limits = []
    if max_runtime:
        limits.append(psutil.Process().create_time() + parse_runtime(max_runtime))
    if env.get("SLURM_JOB_END_TIME", "").isdigit():
        limits.append(float(env["SLURM_JOB_END_TIME"]) - margin_s)
    return min(limits) if limits else None


def stop_file_served(stop_file: str, latest_checkpoint: str | None) -> bool:
    """Whether `stop_file` exists and is older than the checkpoint `latest_checkpoint` (the save it asked
    for came after it)."""
    meta = os.path.join(latest_checkpoint or "", META)  # written last, as the save completes
    if not os.path.exists(stop_file) or not latest_checkpoint or not os.path.isfile(meta):
        return False
    return os.path.getmtime(stop_file) <= os.path.getmtime(meta)


def ignore_stop_signals() -> None:
    """Rollout and critic ranks of a split run: the trainers decide when the run ends and tell them."""
    for sig in StopRequests.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopRequests:
    """The flag the handlers raise; `agreed()` is collective over the trainer ranks."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, stop_file: str, end_by: float | None):
        self.stop_file, self.end_by = stop_file, end_by
        self.reason = ""
        self._previous = {}
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.reason.startswith("SIGINT"):
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.reason = self.reason or signal.Signals(signum).name

    def local_reason(self) -> str:
        if self.reason:
            return self.reason
        if self.stop_file and os.path.exists(self.stop_file):
            return f"stop file {self.stop_file}"
        if self.end_by is not None and time.time() >= self.end_by:
            return "time limit"
        return ""

    def agreed(self, device) -> str:
        """The reason to stop if any trainer rank has one (the lowest rank's), else ""."""
        mine = self.local_reason()
        flag = torch.tensor([float(dist.get_rank()) if mine else float("inf")], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == float("inf"):
            return ""
        box = [mine]
        dist.broadcast_object_list(box, src=int(flag.item()))
        return box[0]

    def at_step_end(self, step: int, total: int, device) -> tuple[str, str]:
        """(the reason to save and stop now, or ""; the reason met at the run's last step, or "": that run ends as
        planned, its stop file served). Collective over the trainer ranks (`agreed`)."""
        reason = self.agreed(device)
        if reason and step == total:
            self.served()
            return "", reason
        return reason, ""

    @staticmethod
    def ended_as_planned(step: int, reason: str) -> None:
        print0(f"stop requested at the last step {step} ({reason}): the run ends as planned")

    def stopped(self, step: int, reason: str, checkpoint: str | None) -> int:
        """After the save a stop asked for: say so, leave STOPPED; the exit code (EXIT_PREEMPTED)."""
        print0(f"saved on signal at step {step} ({reason}): {checkpoint}; the same command resumes it")
        self.mark_stopped(step, reason)
        return EXIT_PREEMPTED

    def clear_stop_file(self, latest_checkpoint: str | None) -> None:
        """A resumed run must not stop again on the file that stopped its predecessor: a stop file older than
        the newest checkpoint was served by that save. A newer one (touched while this run started) stands."""
        if not self.stop_file or dist.get_rank() != 0:
            return
        stopped = os.path.join(os.path.dirname(self.stop_file), STOPPED_FILE)
        if os.path.exists(stopped):
            os.remove(stopped)
        if stop_file_served(self.stop_file, latest_checkpoint):
            os.remove(self.stop_file)

    def served(self) -> None:
        """Rank 0: the stop file asked for a stop the run's own end gave (its last step); a later run with
        more steps must not stop on it."""
        if self.stop_file and dist.get_rank() == 0 and os.path.exists(self.stop_file):
            os.remove(self.stop_file)

    def mark_stopped(self, step: int, reason: str) -> None:
        """Rank 0, after the save: STOPPED beside the stop file says this run saved and stopped early."""
        if self.stop_file and dist.get_rank() == 0:
            with open(os.path.join(os.path.dirname(self.stop_file), STOPPED_FILE), "w") as f:
                f.write(f"step {step} ({reason})\n")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
