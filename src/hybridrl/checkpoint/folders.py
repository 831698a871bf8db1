"""Checkpoint folders on disk: naming, atomic publication, the pointer file, pruning, resume resolution.

A save writes everything into `global_step_{k}.tmp/`; `publish` (rank 0, after every rank finished)
writes meta.json last, renames the folder to `global_step_{k}` and only then replaces the pointer
file. A folder counts as a checkpoint only when it has that name and a meta.json, so a process
killed mid-save leaves a `.tmp` folder that is never taken for one (and is removed by the next
save). No torch.distributed here: the writer (`writer.py`) calls these on the right ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Optional

POINTER = "latest_checkpointed_iteration.txt"  # verl's name
META = "meta.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
PARTIAL = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the folder and the fix."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def read_meta(path: str, required=()) -> dict:
    """A checkpoint's meta.json; CheckpointError when it is unreadable or lacks a `required` key."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{os.path.join(path, META)} cannot be read ({err}); pass another "
                              f"global_step_* folder") from None
    missing = [key for key in required if key not in meta] if isinstance(meta, dict) else list(required)
    if missing:
        raise CheckpointError(f"{path} was not written by this hybridrl ({META} lacks {', '.join(missing)}; "
                              f"older versions saved whole per-rank files) and cannot be resumed; start a new "
                              f"run (trainer.resume_mode=disable)")
    return meta


class CheckpointManager:
    """The `global_step_*` folders under `root` (trainer.default_local_dir), keeping the last `keep`."""

    def __init__(self, root: str, keep: int):
        self.root, self.keep = root, keep

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def prepare(self, step: int) -> str:
        """Rank 0: remove leftovers of killed saves and create the empty partial folder of `step`."""
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):
            if name.endswith(PARTIAL) and os.path.isdir(os.path.join(self.root, name)):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        tmp = self.step_dir(step) + PARTIAL
        os.makedirs(tmp)
        return tmp

    def publish(self, step: int, meta: dict) -> str:
        """Rank 0, after every rank wrote its part: meta.json, rename, pointer, prune."""
        final, tmp = self.step_dir(step), self.step_dir(step) + PARTIAL
        atomic_write_text(os.path.join(tmp, META), json.dumps(dict(meta, step=step), indent=1))
        if os.path.isdir(final):  # re-saving a step (a resumed run): move the old one aside first
            old = f"{final}.old{PARTIAL}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        atomic_write_text(os.path.join(self.root, POINTER), str(step))
        for stale in sorted(self.complete_steps())[:-self.keep]:
            shutil.rmtree(self.step_dir(stale), ignore_errors=True)
        return final

    def complete_steps(self) -> List[int]:
        if not os.path.isdir(self.root):
            return []
        return [int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(self.root))
                if m and os.path.isfile(os.path.join(self.root, m.group(0), META))]

    def latest(self) -> Optional[str]:
        """The pointer's step when that folder is complete, else the highest complete step."""
        pointer = os.path.join(self.root, POINTER)
        if os.path.isfile(pointer):
            text = open(pointer).read().strip()
            if text.isdigit() and os.path.isfile(os.path.join(self.step_dir(int(text)), META)):
                return self.step_dir(int(text))
        steps = self.complete_steps()
        return self.step_dir(max(steps)) if steps else None

    def resolve(self, resume_mode: str) -> Optional[str]:
        """trainer.resume_mode: auto → latest complete checkpoint or None; disable → None; else a path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        check_step_folder(resume_mode)
        return resume_mode


def check_step_folder(path: str, what: str = "trainer.resume_mode") -> None:
    """Raise CheckpointError unless `path` (the value of option `what`) is a complete global_step_*
    folder, saying what it is instead."""
    where = f"{what}={path}"
    if not os.path.exists(path):
        raise CheckpointError(f"{where}: no such folder; pass a global_step_* folder"
                              + (", or auto (the latest under trainer.default_local_dir) or disable"
                                 if what == "trainer.resume_mode" else ""))
    if os.path.isfile(os.path.join(path, META)):
        return
    inner = CheckpointManager(path, 1).latest() if os.path.isdir(path) else None
    if inner:
        raise CheckpointError(f"{where} is a checkpoint root, not one checkpoint; pass {inner}")
    partial = os.path.basename(os.path.normpath(path)).endswith(PARTIAL)
    raise CheckpointError(f"{where} is not a complete checkpoint (no {META}"
                          + ("; an interrupted save" if partial else "")
                          + "); pass a published global_step_* folder")
