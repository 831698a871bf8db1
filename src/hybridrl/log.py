"""Rank-aware logging: one setup, `print0` for rank-0 output, `warn_once`."""
from __future__ import annotations

import logging
import os
import sys

_WARNED = set()


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
