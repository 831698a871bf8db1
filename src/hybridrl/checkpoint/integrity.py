"""What makes a published checkpoint whole, and whether it still is.

At publish, meta.json records every file of the step folder (the actor/ and critic/ shards, rng/, in_flight.pt)
with its size and crc32 under `files`; before a resume they are checked (sizes always, crc32 unless
trainer.verify_checkpoint_digests=false), and the keep rule checks sizes. A checkpoint saved before this record
existed has no `files`: it is loaded unverified. Reads files only; no torch.distributed here: a caller spreads
the work over ranks with `share=(rank, world)`, each rank taking every world-th file.
"""
from __future__ import annotations

import os
import pickle
import zlib
from typing import Dict, Iterable, List, Optional, Tuple

FILES = "files"
"""meta.json's key: {path relative to the step folder: {"bytes": size, "crc32": 8 hex digits}}."""
CHUNK = 8 << 20

# What a file holds, for messages (dist_checkpointing's torch_dist layout, and ours).
HOLDS = {".metadata": "the index of its shards", "common.pt": "the optimizer's settings and step counts",
         "metadata.json": "the format of its shards", ".distcp": "model and optimizer shards",
         "in_flight.pt": "the batch in flight"}


def crc32(path: str) -> str:
    """The crc32 of a file, read in chunks (about 3 GB/s)."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def list_files(folder: str, skip: Iterable[str] = ()) -> List[str]:
    """Every file under `folder` as sorted '/'-separated relative paths, `skip` (top-level names) left out."""
    out = []
    for here, dirs, files in os.walk(folder):
        dirs.sort()
        rel = os.path.relpath(here, folder)
        out += [name if rel == "." else f"{rel}/{name}".replace(os.sep, "/") for name in files]
    return sorted(p for p in out if p not in skip)


def record(folder: str, paths: Iterable[str]) -> Dict[str, dict]:
    """{path: {"bytes", "crc32"}} of `paths` under `folder`."""
    return {p: {"bytes": os.path.getsize(os.path.join(folder, p)), "crc32": crc32(os.path.join(folder, p))}
            for p in paths}


def part_of(path: str) -> str:
    """The part a file belongs to: its top folder (actor, critic, rng) or the file itself (in_flight.pt)."""
    return path.split("/")[0]


def describe(path: str) -> str:
    """`path` with what it holds, e.g. 'actor/common.pt (the optimizer's settings and step counts)'."""
    name = path.split("/")[-1]
    holds = HOLDS.get(name) or HOLDS.get(os.path.splitext(name)[1])
    if part_of(path) == "rng":
        holds = f"the RNG streams of {name.removesuffix('.pt').replace('_', ' ')}"
    return f"{path} ({holds})" if holds else path


def first_damage(folder: str, files: Dict[str, dict], digests: bool, share: Tuple[int, int] = (0, 1),
                 parts: Optional[Iterable[str]] = None) -> Optional[Tuple[int, str]]:
    """(index in sorted order, what is wrong) of the first of this rank's share of `files` that is missing,
    has another size, or (`digests`) other bytes than were saved; None when its share is whole. `parts`
    limits the check to those parts."""
    rank, world = share
    names = sorted(p for p in files if parts is None or part_of(p) in parts)
    for i in range(rank, len(names), world):
        path, saved = os.path.join(folder, names[i]), files[names[i]]
        part = part_of(names[i])
        try:
            size = os.path.getsize(path)
            got = crc32(path) if digests and size == saved["bytes"] else None
        except FileNotFoundError:
            if part != names[i] and not os.path.isdir(os.path.join(folder, part)):
                kept = f" (deleted by trainer.max_{part}_ckpt_to_keep, or lost)" if part in ("actor", "critic") else ""
                return i, f"its {part} part is gone{kept}"
            return i, f"{describe(names[i])} is missing"
        except OSError as err:
            return i, f"{describe(names[i])} cannot be read ({err.strerror or err})"
        if size != saved["bytes"]:
            return i, f"{describe(names[i])} is {size} bytes, {saved['bytes']} were saved"
        if got is not None and got != saved["crc32"]:
            return i, f"{describe(names[i])} holds other bytes than were saved (crc32 {got}, saved {saved['crc32']})"
    return None


def _causes(err: BaseException):
    """`err`, its causes and contexts, and torch.distributed.checkpoint's per-rank failures, each once."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple)]


def file_error(err: BaseException) -> Optional[BaseException]:
    """The error in a loader error's chain that comes from a file's content or absence (rather than from a
    bug): a missing or unreadable file, one that ends early or does not unpickle, a torn torch zip archive."""
    return next((e for e in _causes(err) if isinstance(e, (OSError, EOFError, pickle.UnpicklingError))
                 or "PytorchStreamReader" in str(e)), None)


def shard_damage(folder: str) -> Optional[str]:
    """Without a file list: the first shard file of a torch_dist `folder` that its .metadata indexes and that
    is missing or shorter than the bytes indexed in it (relative to the folder), or an unreadable .metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        index = FileSystemReader(folder).read_metadata().storage_data
    except Exception as err:  # torn pickle, missing file: what it is matters more than its type
        return f".metadata ({HOLDS['.metadata']}) cannot be read ({type(err).__name__})"
    ends = {}
    for info in index.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{describe(name)} is missing"
        if os.path.getsize(path) < end:
            return f"{describe(name)} is {os.path.getsize(path)} bytes, its index needs {end}"
    return None
