"""Rank-aware logging: one setup, `print0` for rank-0 output, `warn_once`; and how every script fails:
`run_cli` turns a user error into one `error: ...` line and exit code 2, leaving bugs their traceback.

Imports no other hybridrl module: the project's error types are looked up in `sys.modules` when an error
arrives (a type whose module was never imported cannot have been raised), so a light script stays light.
"""
from __future__ import annotations

import errno
import logging
import os
import sys

_WARNED = set()

EXIT_USER_ERROR = 2
"""Exit code of a run or script stopped by bad input (argparse's code for bad arguments, too)."""

USER_ERRORS = (("hybridrl.config.checks", "ConfigError"), ("hybridrl.data.prompts", "DataError"),
               ("hybridrl.tokenizer", "TokenizerError"), ("hybridrl.rewards.registry", "RewardError"),
               ("hybridrl.models.hf_config", "UnsupportedConfigError"),
               ("hybridrl.models.hf_checkpoint", "CheckpointMismatchError"),
               ("hybridrl.placement.reshard", "HandoffError"), ("hybridrl.trainer.ppo", "TrainingError"),
               ("hybridrl.trainer.dynamic_sampling", "FilterGroupsError"),
               ("hybridrl.checkpoint.folders", "CheckpointError"), ("hybridrl.metrics", "LoggerError"),
               ("hybridrl.parallel.distributed", "LaunchError"), ("hybridrl.trainer.split", "PeerLostError"))
"""(module, name) of the project's exceptions that carry a message for the user rather than a bug report."""


class UsageError(ValueError):
    """Bad command-line input to a script; the message names the argument and the fix."""


def rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def setup_logging(level: int = logging.INFO) -> None:
    """hybridrl.* loggers print on rank 0 only, warnings and errors on every rank."""
    logger = logging.getLogger("hybridrl")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank{rank()}] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(lambda record: rank() == 0 or record.levelno >= logging.WARNING)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def print0(*args, **kwargs) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logging.getLogger("hybridrl").warning(message)


def user_errors() -> tuple:
    """The exception types of USER_ERRORS whose modules are loaded, and UsageError."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS)
    return (UsageError, *(cls for cls in found if isinstance(cls, type)))


OS_FIXES = {errno.ENOENT: "check the path",
            errno.ENOTDIR: "a file stands where a folder is needed; move it away or pass another path",
            errno.EEXIST: "a file stands where a folder is needed; move it away or pass another path",
            errno.EISDIR: "a folder stands where a file is needed; pass a file",
            errno.EACCES: "make it writable (or readable) or pass another folder",
            errno.EPERM: "make it writable (or readable) or pass another folder",
            errno.EROFS: "the file system is read-only; pass a folder on a writable one",
            errno.ENOSPC: "free space there or pass a folder on another disk",
            errno.EDQUOT: "free space there (disk quota) or pass a folder on another disk",
            errno.EFBIG: "the file outgrew the size limit (ulimit -f); raise it or pass a folder on another disk"}


def os_error_message(err: OSError, path: str = "") -> str:
    """One line for the file system refusing a path (`err.filename`, else `path`): what happened and the fix."""
    fix = OS_FIXES.get(err.errno, "check the path and the disk")
    return f"{err.strerror or err}: {err.filename or path}; {fix}"


def run_cli(main, *args) -> int:
    """`main(*args)`'s exit code; a user error (USER_ERRORS, UsageError, or the file system refusing a
    named path: a missing input, an output folder that is read-only or full) prints one `error: ...`
    line on stderr and gives EXIT_USER_ERROR. Any other exception is a bug and keeps its traceback."""
    hard = False
    try:
        return main(*args) or 0
    except user_errors() as err:
        message, hard = str(err), getattr(err, "exit_at_once", False)
    except OSError as err:
        if err.filename is None:
            raise
        message = os_error_message(err)
    print(f"error: {message}", file=sys.stderr, flush=True)
    if hard:  # a peer that hangs keeps its connections open: tearing down the process groups would wait on it
        sys.stdout.flush()
        os._exit(EXIT_USER_ERROR)
    return EXIT_USER_ERROR
