"""Save and resume a run, collectively: the trainable roles through dist_checkpointing, per-rank RNG
streams, and meta.json (step, data loader position, KL coefficient, layout, HF config).

    global_step_{k}/actor/ , critic/   torch_dist folders (model + optimizer, one copy per shard)
    global_step_{k}/rng/rank_{r}.pt    RNG streams, restored only at the layout they were saved at
    global_step_{k}/meta.json          written last, with every file's size and crc32, then the folder is
                                       renamed into place
With `async_save` the shards are written by megatron-core's async writer (a forked process that
sees this moment's tensors; on GPU a host copy is taken first) while training goes on; `poll`
after each step and `finalize` publish the folder once every rank is done, and a new save first
finishes the one before it, so checkpoints appear whole and in order. Old checkpoints are pruned only
after that publication. A folder that cannot be written (read-only, full, a file in the way) raises the
same CheckpointError on every rank, naming the folder, the cause and the last complete checkpoint,
which stays as it was.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import signal
from typing import Dict

import torch
import torch.distributed as dist

from hybridrl.checkpoint.folders import META, PARTIAL, CheckpointError, CheckpointManager, read_meta
from hybridrl.checkpoint.integrity import FILES, list_files, record
from hybridrl.checkpoint.resume import naming_damage
from hybridrl.checkpoint.rng import rng_state, set_rng_state
from hybridrl.checkpoint.sharded import load_role, save_role
from hybridrl.models.lora_export import check_resume
from hybridrl.log import os_error_message

RNG_DIR = "rng"
RUN_KEYS = {"rl": ("step", "roles", "data", "kl_coef", "layout", "hf_config"),
            "sft": ("step", "roles", "data", "layout", "hf_config")}
"""What a resume reads from meta.json, by the kind of run that wrote it (meta "run"; absent: an RL run's)."""


def _rng_file(folder: str, rank: int) -> str:
    return os.path.join(folder, RNG_DIR, f"rank_{rank:05d}.pt")


def _save_file(obj, path: str) -> None:
    """torch.save through a buffer, so a full disk raises an OSError (torch's own writer, a RuntimeError)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


@contextlib.contextmanager
def _stop_signals_held():
    """SIGTERM and SIGUSR1 held back (pending, not lost) while megatron-core starts its write helpers (the async
    writer, the spawn context's resource tracker), which inherit the mask and so live through a job-wide signal
    (SLURM's pre-emption, torchrun's forwarding) that would kill them mid-write and fail the very save the
    signal asked for. The run's own handler gets the signal afterwards."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _ignore_stop_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _write_results_queue() -> None:
    """megatron-core's write-results queue, which every save reuses, started at the first save by a Manager
    process that ignores the stop signals (megatron would start a plain one, which a job-wide SIGTERM or SIGUSR1
    killed: the save on signal then failed with a broken pipe)."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", 0) is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_ignore_stop_signals)
        filesystem_async._results_queue = manager.Queue()  # the queue's proxy keeps its manager alive


class CheckpointWriter:
    """Writes `global_step_*` folders under a CheckpointManager's root; every rank calls every method."""

    def __init__(self, folders: CheckpointManager, async_save: bool = False):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.folders = folders
        self.queue = AsyncCallsQueue() if async_save else None
        self.pending = 0  # the step of the async save in flight

    def save(self, step: int, workers: Dict[str, object], meta: dict, extra: Dict[str, object] | None = None,
             others: Dict[str, object] | None = None) -> None:
        """Write `workers` ({"actor": ActorWorker, ...}), `meta` and, from rank 0, `extra` ({file name:
        object for torch.save}); `others` ({role: save(folder)}) are roles that other ranks write (a
        critic of its own), called before this world's writes. Published now, or when the async write
        is done."""
        from torch.distributed.checkpoint.api import CheckpointException

        others = others or {}
        self.finalize()
        rank, tmp = dist.get_rank(), self.folders.step_dir(step) + PARTIAL
        self._agree(step, lambda: self._make_folders(step, [*workers, *others, RNG_DIR]) if rank == 0 else None)

        def local_writes():
            for role, save in others.items():
                save(os.path.join(tmp, role))
            _save_file(rng_state(), _rng_file(tmp, rank))
            for name, obj in (extra or {}).items():
                if rank == 0 and obj is not None:
                    _save_file(obj, os.path.join(tmp, name))

        self._agree(step, local_writes)  # every rank learns of a failure before the collective write
        is_async = self.queue is not None
        try:
            with _stop_signals_held():
                _write_results_queue()
                requests = [save_role(w, os.path.join(tmp, role), is_async) for role, w in workers.items()]
        except (OSError, CheckpointException) as err:  # raised on every rank: megatron gathers write results
            raise self._failed(step, err) from None
        publish = functools.partial(self._publish, step, dict(meta, roles=sorted([*workers, *others])))
        if not is_async:
            publish()
            return
        requests[-1].add_finalize_fn(publish)  # finalized in order: the last one means all are written
        with _stop_signals_held():
            for request in requests:
                self.queue.schedule_async_request(request)
        self.pending = step

    def _make_folders(self, step: int, subs) -> None:
        tmp = self.folders.prepare(step)
        for sub in subs:
            os.makedirs(os.path.join(tmp, sub))

    def _publish(self, step: int, meta: dict) -> None:
        dist.barrier()  # every rank's writes are done
        files = self._record_files(step)
        self._agree(step, lambda: self.folders.publish(step, dict(meta, **{FILES: files}))
                    if dist.get_rank() == 0 else None)

    def _record_files(self, step: int) -> dict:
        """Every file of the written folder with its size and crc32, each rank reading every world-th file."""
        tmp, rank, world = self.folders.step_dir(step) + PARTIAL, dist.get_rank(), dist.get_world_size()
        names = [list_files(tmp, skip=(META,)) if rank == 0 else None]
        dist.broadcast_object_list(names, src=0)
        mine = {}
        self._agree(step, lambda: mine.update(record(tmp, names[0][rank::world])))
        shares = [None] * world
        dist.all_gather_object(shares, mine)
        return dict(sorted((name, entry) for share in shares for name, entry in share.items()))

    def _agree(self, step: int, write) -> None:
        """Run `write` on this rank; when it fails on any rank, raise the same CheckpointError on all."""
        try:
            write()
            problem = None
        except OSError as err:
            problem = self._failed(step, err).args[0]
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
        if problem:
            raise CheckpointError(problem)

    def _failed(self, step: int, err: BaseException) -> CheckpointError:
        """The CheckpointError of a save that could not be written: what failed, the fix, what is intact."""
        cause = err
        for failed, _trace in getattr(err, "failures", {}).values():  # megatron's CheckpointException
            cause = failed
            break
        if isinstance(cause, OSError):
            why = os_error_message(cause, self.folders.step_dir(step) + PARTIAL)
        elif cause is err and hasattr(err, "failures"):
            why = "another rank could not write its shards (its own message names the cause)"
        else:  # torch's own file writer reports a full disk as a RuntimeError
            why = (f"{type(cause).__name__}: {cause}".splitlines()[0]
                   + f" (check that {self.folders.root} is writable and its disk has free space)")
        latest = self.folders.latest()
        return CheckpointError(
            f"could not write the checkpoint of step {step} under trainer.default_local_dir={self.folders.root}: "
            f"{why}; nothing older was deleted: the last complete checkpoint is "
            + (f"{latest}, and the same command resumes from it" if latest else "none yet"))

    def poll(self) -> None:
        """Publish an async save whose writes finished on every rank (one small all-reduce)."""
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            self._finish(blocking=False)

    def finalize(self) -> None:
        """Wait for a pending async save and publish it."""
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            self._finish(blocking=True)

    def _finish(self, blocking: bool) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except (OSError, CheckpointException) as err:  # a shard the background writer could not write
            self._abandon_pending()
            raise self._failed(self.pending, err) from None

    def _abandon_pending(self) -> None:
        """After a failed async write: wait for the writers of the save's other roles (one process each) and
        drop their results. Left running, one outlived the run and its results queue (megatron's manager
        process, stopped at exit) and printed a traceback under the run's one error line."""
        import queue

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        while self.queue.async_calls:
            self.queue.async_calls.popleft().async_caller.close()
        results = getattr(filesystem_async, "_results_queue", None)
        while results is not None:
            try:
                results.get_nowait()
            except (queue.Empty, OSError, EOFError):
                break


def layout_of(groups) -> dict:
    """What decides which rank a saved RNG stream belongs to (`same_layout`)."""
    return {"tp": groups.tp, "pp": groups.pp, "dp": groups.dp, "cp": groups.cp, "ep": groups.ep}


def same_layout(saved: dict, current: dict) -> bool:
    """Whether rank r's saved RNG streams are rank r's here: every parallel size equal (context and expert
    parallel 1 where a checkpoint from before they were recorded does not say)."""
    sizes = {"cp": 1, "ep": 1}
    return {**sizes, **saved} == {**sizes, **current}


def _other_run(path: str, saved: str) -> str:
    if saved == "sft":
        return (f"{path} is an SFT checkpoint (scripts/train_sft.py): an RL run starts from SFT weights with "
                f"model.path=<its sft.output_dir> (`scripts/convert_checkpoint.py ckpt-to-hf --input {path}` "
                "writes this one's)")
    return (f"{path} is an RL checkpoint, not an SFT one: pass sft.resume_mode a global_step_* folder under "
            "sft.default_local_dir, or sft.resume_mode=disable")


def load_checkpoint(path: str, workers: Dict[str, object], layout: dict, run: str = "rl") -> dict:
    """Load `workers` from a published folder at this run's layout; returns its meta.json. `run`: the kind of run
    resuming (rl, sft), which must be the kind that saved it."""
    saved = read_meta(path)
    saved = saved.get("run", "rl") if isinstance(saved, dict) else run
    if saved != run:
        raise CheckpointError(_other_run(path, saved))
    meta = read_meta(path, RUN_KEYS[run])
    if "actor" in workers:  # LoRA: the adapters fit their own settings and base only
        try:
            check_resume(path, meta.get("lora"), workers["actor"].engine.module)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
    for role, worker in workers.items():
        folder = os.path.join(path, role)
        if role in meta["roles"] and not os.path.isdir(folder):
            raise CheckpointError(f"{path} no longer holds its {role} state (deleted by trainer.max_{role}_ckpt_to_keep "
                                  f"once newer checkpoints existed); resume from a newer global_step_* folder")
        if role not in meta["roles"]:
            raise CheckpointError(f"{path} has no {role} state (saved by a run without a {role}); resume "
                                  f"with the algorithm.adv_estimator it was saved with, or trainer.resume_mode=disable")
        load_role(worker, folder, role)
    rng = _rng_file(path, dist.get_rank())
    if same_layout(meta["layout"], layout) and os.path.isfile(rng):
        with naming_damage(path, RNG_DIR, path=rng):
            state = torch.load(rng, weights_only=False)
        set_rng_state(state)
    return meta
