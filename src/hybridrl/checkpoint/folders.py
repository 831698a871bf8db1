"""Checkpoint folders on disk: naming, atomic publication, the pointer file, pruning, what a resume may take.

A save writes everything into `global_step_{k}.tmp/`; `publish` (rank 0, after every rank finished)
writes meta.json last, renames the folder to `global_step_{k}` and only then replaces the pointer
file. A folder counts as a checkpoint only when it has that name and a meta.json, so a process
killed mid-save leaves a `.tmp` folder that is never taken for one (and is removed by the next
save). meta.json also lists every file with its size and crc32 (`integrity.py`), so a checkpoint damaged
after publication (a truncated or lost shard) is recognised before it is loaded. Only then are old checkpoints
pruned, each role's part on its own count (verl's trainer.max_{actor,critic}_ckpt_to_keep), counting only parts
whose files have their saved sizes: a damaged part is neither counted nor deleted. A part, or a step folder with
no part left, is renamed to a `.tmp` name before it is deleted, so an interrupted deletion never leaves a torn
checkpoint. No torch.distributed here: the writer (`writer.py`) calls these on the right ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Iterable, List, Optional, Tuple, Union

from hybridrl.checkpoint.integrity import FILES, first_damage, part_of

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
    """The `global_step_*` folders under `root` (trainer.default_local_dir). `keep` bounds how many
    complete checkpoints keep each role's part: {"actor": 2, "critic": None} (None or 0: all), or one
    number for every role."""

    def __init__(self, root: str, keep: Union[int, None, Dict[str, Optional[int]]] = None):
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
        """Rank 0, after every rank wrote its part: meta.json, rename, pointer, then prune."""
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
        self.prune(newest=step)
        return final

    def limit(self, role: str) -> Optional[int]:
        """How many checkpoints keep `role`'s part; None: all."""
        keep = self.keep.get(role) if isinstance(self.keep, dict) else self.keep
        return keep or None

    def listed_roles(self, step: int) -> List[str]:
        """The roles meta.json says the checkpoint was saved with ([] when it cannot be read)."""
        try:
            roles = read_meta(self.step_dir(step)).get("roles", [])
        except (CheckpointError, AttributeError):
            return []
        return list(roles)

    def prune(self, newest: int) -> None:
        """Delete each role's part of the complete checkpoints beyond its limit, oldest steps first; the
        checkpoint just published (`newest`) always stays, partial `.tmp` folders are never counted, a part
        whose files lack their saved sizes is neither counted nor deleted (so the newest intact part stays
        while a newer one is damaged), and a step folder whose parts are all gone goes whole."""
        steps = sorted(self.complete_steps())
        listed = {s: self.listed_roles(s) for s in steps}
        kept = {s: {r for r in listed[s] if os.path.isdir(os.path.join(self.step_dir(s), r))} for s in steps}
        # a part counts when its files and the step's shared ones (rng/, in_flight.pt) are whole: a resume needs both
        whole = {s: {r for r in kept[s] if not step_damage(self.step_dir(s), False, parts=(r,))}
                 if not step_damage(self.step_dir(s), False, parts=self._shared_parts(s, listed[s])) else set()
                 for s in steps}
        for role in sorted(set().union(*kept.values())):
            limit = self.limit(role)
            if limit is None:
                continue
            older = [s for s in steps if role in whole[s] and s != newest]
            room = limit - (role in whole.get(newest, ()))  # the newest counts against the limit
            for s in older[:max(0, len(older) - room)]:
                _remove(os.path.join(self.step_dir(s), role))
                kept[s].discard(role)
        for s in steps:
            if s != newest and listed[s] and not kept[s]:
                _remove(self.step_dir(s))
            elif os.path.isdir(self.step_dir(s)):  # parts whose deletion a killed run left behind
                for name in os.listdir(self.step_dir(s)):
                    if name.endswith(PARTIAL):
                        shutil.rmtree(os.path.join(self.step_dir(s), name), ignore_errors=True)

    def _shared_parts(self, step: int, roles) -> set:
        """The parts of a step's file list that belong to no role (rng/, in_flight.pt)."""
        try:
            files = read_meta(self.step_dir(step)).get(FILES) or {}
        except (CheckpointError, AttributeError):
            return set()
        return {part_of(p) for p in files} - set(roles)

    def complete_steps(self) -> List[int]:
        if not os.path.isdir(self.root):
            return []
        return [int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(self.root))
                if m and os.path.isfile(os.path.join(self.root, m.group(0), META))]

    def _pointer(self) -> Optional[int]:
        """The step the pointer file names, if it names one."""
        pointer = os.path.join(self.root, POINTER)
        text = open(pointer).read().strip() if os.path.isfile(pointer) else ""
        return int(text) if text.isdigit() else None

    def latest(self) -> Optional[str]:
        """The pointer's step when that folder is complete, else the highest complete step."""
        pointer = self._pointer()
        if pointer is not None and os.path.isfile(os.path.join(self.step_dir(pointer), META)):
            return self.step_dir(pointer)
        steps = self.complete_steps()
        return self.step_dir(max(steps)) if steps else None

    def candidates(self) -> List[str]:
        """Every global_step_* folder, meta.json or not, in the order a resume tries them: the pointer's
        step first (the last one published), then the highest steps first."""
        if not os.path.isdir(self.root):
            return []
        steps = sorted((int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(self.root))
                        if m and os.path.isdir(os.path.join(self.root, m.group(0)))), reverse=True)
        pointer = self._pointer()
        if pointer in steps:
            steps.remove(pointer)
            steps.insert(0, pointer)
        return [self.step_dir(s) for s in steps]


def _remove(path: str) -> None:
    """Rename `path` to a partial name (never taken for a checkpoint part), then delete it."""
    doomed = f"{path}.del{PARTIAL}"
    try:
        os.replace(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


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
    inner = CheckpointManager(path).latest() if os.path.isdir(path) else None
    if inner:
        raise CheckpointError(f"{where} is a checkpoint root, not one checkpoint; pass {inner}")
    partial = os.path.basename(os.path.normpath(path)).endswith(PARTIAL)
    raise CheckpointError(f"{where} is not a complete checkpoint (no {META}"
                          + ("; an interrupted save" if partial else "")
                          + "); pass a published global_step_* folder")


def step_damage(path: str, digests: bool, share: Tuple[int, int] = (0, 1),
                parts: Optional[Iterable[str]] = None) -> Optional[Tuple[int, str]]:
    """(index, what is wrong) when the global_step_* folder `path` is not whole: no or an unreadable meta.json
    (index -1), else the first damaged file of this rank's share (`integrity.first_damage`; `parts` limits the
    check to those parts). None when whole, or when meta.json lists no files (saved before they were listed)."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        empty = os.path.isdir(path) and not os.listdir(path)
        return -1, f"it has no {META}" + ("; the folder is empty" if empty else "")
    except (OSError, ValueError) as err:
        return -1, f"its {META} cannot be read ({err})"
    files = meta.get(FILES) if isinstance(meta, dict) else None
    return first_damage(path, files, digests, share, parts) if files else None


def lists_files(path: str) -> bool:
    """Whether the checkpoint's meta.json lists its files (those saved before this was recorded do not)."""
    try:
        return bool(read_meta(path).get(FILES))
    except (CheckpointError, AttributeError):
        return False
