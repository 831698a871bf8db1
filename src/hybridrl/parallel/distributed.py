"""Start torch.distributed and megatron-core's parallel_state from torchrun or SLURM variables.

gloo when CUDA is absent, nccl otherwise. This is the only module that creates process groups;
the groups are handed to the rest of the code in a `ParallelGroups` object.
"""
from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridrl.parallel import cpu_compat


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM nodelist such as 'gpu[012-015,020],cpu1' (no scontrol needed)."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_env(environ=None) -> LaunchEnv:
    """Rank layout from torchrun (RANK, WORLD_SIZE, ...) or srun (SLURM_PROCID, ...), else single process
    (on MASTER_PORT when given, else on a free port)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         addr, int(env.get("MASTER_PORT", 29500)))
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else free_port()
    return LaunchEnv(0, 1, 0, "127.0.0.1", port)


def free_port() -> int:
    """A port no process listens on now: a single-process run must not collide with another run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_launch_env(le: LaunchEnv, environ=None) -> None:
    """Set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT from `le` where the launcher did not.

    A bare `srun` sets only SLURM_* variables; vLLM's `external_launcher` reads RANK and LOCAL_RANK.
    """
    env = os.environ if environ is None else environ
    for key, value in (("RANK", le.rank), ("LOCAL_RANK", le.local_rank), ("WORLD_SIZE", le.world_size),
                       ("MASTER_ADDR", le.master_addr), ("MASTER_PORT", le.master_port)):
        env.setdefault(key, str(value))


def run_device() -> torch.device:
    """The one device of this process: its CUDA device (set from LOCAL_RANK at init), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_ORPHAN_GUARD = []


def _pdeathsig(expected_parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG); exit now if it already has."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
    if os.getppid() != expected_parent:
        os._exit(1)


def die_with_parent() -> None:
    """From now on every process forked from this one gets SIGKILL when this process dies, however it dies
    (PR_SET_PDEATHSIG, set in the child right after fork): a killed run leaves no child holding its port
    or its files. Spawned children (megatron's async checkpoint writer) call `die_with_parent_if_spawned`
    as they import the entry point. Idempotent; a no-op off Linux."""
    if _ORPHAN_GUARD or not sys.platform.startswith("linux"):
        return
    forking = [0]
    os.register_at_fork(before=lambda: forking.__setitem__(0, os.getpid()),
                        after_in_child=lambda: _pdeathsig(forking[0]))
    _ORPHAN_GUARD.append(forking)


def die_with_parent_if_spawned() -> None:
    """In a multiprocessing `spawn` child, which imports the parent's main module while it starts (then
    `current_process()._inheriting` is set, the one marker spawn leaves): die with the parent."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False) and sys.platform.startswith("linux"):
        _pdeathsig(os.getppid())


PORT_TRIES = 5
"""How many free ports a single-process run tries: another process may take the port between its choice
and the bind (tests running side by side do)."""


def die_with_launcher() -> None:
    """A rank started by torchrun lives in a session of its own (torch's elastic agent starts it so): a kill
    of torchrun, or of its process group, never reaches it, and it would train on alone. It dies with the
    agent instead (PR_SET_PDEATHSIG on itself); a no-op off Linux or without torchrun."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        _pdeathsig(os.getppid())


def init_distributed(timeout_s: int = 600) -> LaunchEnv:
    """Initialise the default process group (idempotent) and the CPU patches when there is no CUDA."""
    die_with_parent()
    die_with_launcher()
    le = launch_env()
    chose_port = le.world_size == 1 and not os.environ.get("MASTER_PORT")  # launch_env picked a free one
    export_launch_env(le)
    cpu_compat.apply()
    if dist.is_initialized():
        return le
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(le.local_rank)
    tries = PORT_TRIES if chose_port else 1
    for attempt in range(tries):
        try:
            dist.init_process_group(backend, init_method=f"tcp://{le.master_addr}:{le.master_port}",
                                    rank=le.rank, world_size=le.world_size, timeout=timedelta(seconds=timeout_s))
            return le
        except dist.DistNetworkError as err:
            if "EADDRINUSE" not in str(err):
                raise
            if attempt + 1 < tries:
                le = LaunchEnv(le.rank, le.world_size, le.local_rank, le.master_addr, free_port())
                os.environ["MASTER_PORT"] = str(le.master_port)
    if chose_port:
        raise LaunchError(f"{PORT_TRIES} free ports in a row were taken before this run could bind them; "
                          f"set MASTER_PORT to a port no other process uses")
    raise LaunchError(f"MASTER_PORT={le.master_port} on {le.master_addr} is already in use (another run?); "
                      f"set MASTER_PORT to a free port, or unset it in a single-process run to get one")


class LaunchError(RuntimeError):
    """The process group cannot start as launched; the message names the fix."""


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups and ranks a role needs, passed explicitly instead of read from globals."""
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    mp_group: object  # tp x pp: one model replica
    device: torch.device = torch.device("cpu")
    """Where this process's batch tensors live and its collectives run (`run_device()`)."""
    ep: int = 1
    """Expert parallel size: MoE experts are split over `ep` ranks of the data-parallel dimension."""
    ep_rank: int = 0
    ep_group: object = None
    cp: int = 1
    """Context parallel size: each sequence split over `cp` ranks that hold the same rows and weights."""
    cp_rank: int = 0
    cp_group: object = None
    replica_group: object = None
    """Every rank of this model replica (tp x cp x pp: the ranks that hold one DP shard's rows); None: mp_group."""

    @property
    def replica(self):
        return self.mp_group if self.replica_group is None else self.replica_group

    @property
    def replica_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def agreed_random_seed() -> int:
    """A seed rank 0 draws at random, the same on every rank of the job (collective)."""
    drawn = [secrets.randbelow(2**31 - 1) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(drawn, src=0)
    return int(drawn[0])


def init_model_parallel(tp: int, pp: int, seed: int = 1234, ep: int = 1, cp: int = 1) -> ParallelGroups:
    """megatron-core parallel_state with TP, CP, PP and expert parallel EP (DP derived), seeded RNG tracker.
    Expert TP is TP (megatron's default)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_groups()


_REPLICA_GROUPS = {}


def _replica_group(dp_rank: int, layout: tuple):
    """The group of every rank with this data-parallel rank (one model replica across TP, CP and PP);
    collective on the world (each replica's group is created by every rank, in DP order)."""
    key = (id(dist.group.WORLD), layout)
    if key not in _REPLICA_GROUPS:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dp_rank)
        groups = {d: dist.new_group([r for r, rd in enumerate(ranks) if rd == d]) for d in sorted(set(ranks))}
        _REPLICA_GROUPS[key] = groups[dp_rank]
    return _REPLICA_GROUPS[key]


def current_groups() -> ParallelGroups:
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(), mp_group=ps.get_model_parallel_group(), device=run_device(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(check_initialized=False),
        cp=cp, cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group(),
        replica_group=_replica_group(ps.get_data_parallel_rank(), (ps.get_tensor_model_parallel_world_size(), cp,
                                                                   ps.get_pipeline_model_parallel_world_size()))
        if cp > 1 else None)


def destroy() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
