"""Which checkpoint a run resumes from, checked before anything is loaded, and what a failed load names.

trainer.resume_mode=auto takes the newest intact checkpoint: a damaged one (a file missing, of another
size, or with other bytes than were saved; no meta.json) is skipped with one warning line naming it and
why, and left in place; none intact ends the run with one CheckpointError. A damaged folder passed by
name fails naming the file and the intact ones beside it. Collective over the ranks that call it (the
trainers): each reads its share of the files, so a resume reads every byte once, not once per rank.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterable, Optional

import torch.distributed as dist

from hybridrl.checkpoint.folders import (STEP_DIR, CheckpointError, CheckpointManager, check_step_folder, lists_files,
                                        step_damage)
from hybridrl.checkpoint.integrity import describe, file_error, shard_damage
from hybridrl.log import print0, rank


RESUME_ELSEWHERE = "resume from another checkpoint (trainer.resume_mode=auto skips damaged ones)"


def damage(path: str, digests: bool, parts: Optional[Iterable[str]] = None) -> Optional[str]:
    """What is wrong with the checkpoint `path` (None: whole, or saved before files were listed); the same
    answer on every rank of the default group, which share the reading."""
    share = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = step_damage(path, digests, share, tuple(parts) if parts else None)
    if share[1] > 1:
        views = [None] * share[1]
        dist.all_gather_object(views, found)
        found = min((v for v in views if v), default=None)
    return found[1] if found else None


def _note_unverified(path: str) -> None:
    if not lists_files(path):
        print0(f"note: {path} was saved before checkpoints listed their files: loading it unverified")


def choose_checkpoint(folders: CheckpointManager, resume_mode: str, digests: bool) -> Optional[str]:
    """trainer.resume_mode: disable -> None; auto -> the newest intact checkpoint under the root (None when
    there is none at all); a path -> that checkpoint, when whole, except in a requeued SLURM job that has saved
    past it under its own root: its newest intact checkpoint there (the requeue repeats the command line, which
    would otherwise start from the named one every time). CheckpointError otherwise."""
    if resume_mode == "disable":
        return None
    if resume_mode != "auto" and _requeued():
        later = _later_own_checkpoint(folders, resume_mode, digests)
        if later is not None:
            print0(f"resuming from {later}, this job's own newer checkpoint, not trainer.resume_mode={resume_mode}: "
                   "the job was requeued (SLURM_RESTART_COUNT) after it had saved past that one")
            return later
    if resume_mode != "auto":
        named = os.path.normpath(resume_mode)
        if not (os.path.isdir(named) and STEP_DIR.match(os.path.basename(named))):
            check_step_folder(resume_mode)  # no folder, a root, an interrupted save: says which
        problem = damage(resume_mode, digests)
        if problem:
            raise CheckpointError(f"trainer.resume_mode={resume_mode} is damaged: {problem}; "
                                  + _alternatives(os.path.dirname(os.path.normpath(resume_mode)), resume_mode))
        _note_unverified(resume_mode)
        return resume_mode
    skipped = []
    for path in folders.candidates():
        problem = damage(path, digests)
        if problem is None:
            for name, why in skipped if rank() == 0 else ():
                print(f"warning: skipping the damaged checkpoint {name} ({why}); it stays until a new save of its "
                      f"step replaces it; resuming from {path}", file=sys.stderr, flush=True)
            _note_unverified(path)
            return path
        skipped.append((path, problem))
    if skipped:
        raise CheckpointError(f"no intact checkpoint under trainer.default_local_dir={folders.root} to resume from: "
                              + "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
                              + "; move them aside to start afresh, or pass a checkpoint kept elsewhere to "
                                "trainer.resume_mode")
    return None


def _requeued() -> bool:
    return os.environ.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0")


def _later_own_checkpoint(folders: CheckpointManager, named: str, digests: bool) -> Optional[str]:
    """The newest intact checkpoint under the run's own root of a later step than the folder `named`, or None."""
    m = STEP_DIR.match(os.path.basename(os.path.normpath(named)))
    if m is None:
        return None
    for path in folders.candidates():
        step = STEP_DIR.match(os.path.basename(path))
        if step and int(step.group(1)) > int(m.group(1)) and damage(path, digests) is None:
            return path
    return None


def _alternatives(root: str, damaged: str) -> str:
    """The intact checkpoints beside `damaged` (file sizes checked), as the end of an error message."""
    intact = [p for p in CheckpointManager(root).candidates()
              if os.path.normpath(p) != os.path.normpath(damaged) and step_damage(p, digests=False) is None]
    if not intact:
        return "no other checkpoint there is intact"
    return f"intact checkpoints there (file sizes checked): {', '.join(intact)}; pass one, or trainer.resume_mode=auto"


@contextlib.contextmanager
def naming_damage(step: str, part: str, fix: str = RESUME_ELSEWHERE, path: Optional[str] = None):
    """Inside: a loader error caused by a file of the `part` of checkpoint folder `step` (`path`, when one
    file is read) becomes a CheckpointError naming the step, the part, the file and `fix`; any other error
    goes on as it is (a bug keeps its traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        yield
    except (Exception, CheckpointException) as err:
        cause = file_error(err)
        if cause is None:
            raise
        raise CheckpointError(f"could not load the {part} part of {step}: {_what_failed(step, part, cause, path)}; "
                              f"{fix}") from None


def _what_failed(step: str, part: str, cause: BaseException, path: Optional[str]) -> str:
    found = step_damage(step, digests=True, parts=(part,))
    if found and found[0] >= 0:  # the files meta.json lists tell which one
        return found[1]
    path = cause.filename if isinstance(cause, OSError) and cause.filename else path
    if path is None and os.path.isdir(os.path.join(step, part)):  # saved before files were listed
        damaged = shard_damage(os.path.join(step, part))
        if damaged:
            return f"{part}/{damaged}"
    what = describe(os.path.relpath(path, step).replace(os.sep, "/")) if path else f"a file of {part}/"
    if isinstance(cause, FileNotFoundError):
        return f"{what} is missing"
    why = cause.strerror if isinstance(cause, OSError) and cause.strerror else \
        f"{type(cause).__name__}: {cause}".split(". ")[0].rstrip(": ")
    return f"{what} cannot be read ({why})"
