"""Save and resume a run, collectively: the trainable roles through dist_checkpointing, per-rank RNG
streams, and meta.json (step, data loader position, KL coefficient, layout, HF config).

    global_step_{k}/actor/ , critic/   torch_dist folders (model + optimizer, one copy per shard)
    global_step_{k}/rng/rank_{r}.pt    RNG streams, restored only at the layout they were saved at
    global_step_{k}/meta.json          written last, then the folder is renamed into place
With `async_save` the shards are written by megatron-core's async writer (a forked process that
sees this moment's tensors; on GPU a host copy is taken first) while training goes on; `poll`
after each step and `finalize` publish the folder once every rank is done, and a new save first
finishes the one before it, so checkpoints appear whole and in order.
"""
from __future__ import annotations

import functools
import os
from typing import Dict

import torch
import torch.distributed as dist

from hybridrl.checkpoint.folders import PARTIAL, CheckpointError, CheckpointManager, read_meta
from hybridrl.checkpoint.rng import rng_state, set_rng_state
from hybridrl.checkpoint.sharded import load_role, save_role

RNG_DIR = "rng"
RUN_KEYS = ("step", "roles", "data", "kl_coef", "layout", "hf_config")  # what a resume reads from meta.json


def _rng_file(folder: str, rank: int) -> str:
    return os.path.join(folder, RNG_DIR, f"rank_{rank:05d}.pt")


class CheckpointWriter:
    """Writes `global_step_*` folders under a CheckpointManager's root; every rank calls every method."""

    def __init__(self, folders: CheckpointManager, async_save: bool = False):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.folders = folders
        self.queue = AsyncCallsQueue() if async_save else None

    def save(self, step: int, workers: Dict[str, object], meta: dict, extra: Dict[str, object] | None = None,
             others: Dict[str, object] | None = None) -> None:
        """Write `workers` ({"actor": ActorWorker, ...}), `meta` and, from rank 0, `extra` ({file name:
        object for torch.save}); `others` ({role: save(folder)}) are roles that other ranks write (a
        critic of its own), called before this world's writes. Published now, or when the async write
        is done."""
        others = others or {}
        self.finalize()
        rank, tmp = dist.get_rank(), self.folders.step_dir(step) + PARTIAL
        if rank == 0:
            self.folders.prepare(step)
            for sub in (*workers, *others, RNG_DIR):
                os.makedirs(os.path.join(tmp, sub))
        dist.barrier()
        for role, save in others.items():
            save(os.path.join(tmp, role))
        torch.save(rng_state(), _rng_file(tmp, rank))
        for name, obj in (extra or {}).items():
            if rank == 0 and obj is not None:
                torch.save(obj, os.path.join(tmp, name))
        is_async = self.queue is not None
        requests = [save_role(w, os.path.join(tmp, role), is_async) for role, w in workers.items()]
        publish = functools.partial(self._publish, step, dict(meta, roles=sorted([*workers, *others])))
        if not is_async:
            publish()
            return
        requests[-1].add_finalize_fn(publish)  # finalized in order: the last one means all are written
        for request in requests:
            self.queue.schedule_async_request(request)

    def _publish(self, step: int, meta: dict) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            self.folders.publish(step, meta)
        dist.barrier()

    def poll(self) -> None:
        """Publish an async save whose writes finished on every rank (one small all-reduce)."""
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False)

    def finalize(self) -> None:
        """Wait for a pending async save and publish it."""
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=True)


def load_checkpoint(path: str, workers: Dict[str, object], layout: dict) -> dict:
    """Load `workers` from a published folder at this run's layout; returns its meta.json."""
    meta = read_meta(path, RUN_KEYS)
    for role, worker in workers.items():
        folder = os.path.join(path, role)
        if role not in meta["roles"] or not os.path.isdir(folder):
            raise CheckpointError(f"{path} has no {role} state (saved by a run without a {role}); resume "
                                  f"with the algorithm.adv_estimator it was saved with, or trainer.resume_mode=disable")
        load_role(worker, folder, role)
    rng = _rng_file(path, dist.get_rank())
    if meta["layout"] == layout and os.path.isfile(rng):
        set_rng_state(torch.load(rng, weights_only=False))
    return meta
