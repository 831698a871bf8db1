"""Run a test body in N gloo processes and surface the failing rank's traceback.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, each with torchrun-style
environment variables, initialises torch.distributed (gloo) and hybridrl's CPU patches, calls
`fn(*args)` and returns the list of per-rank return values. `fn` must be a module-level function.
With `on_virtual_device=True` the body runs on the emulated accelerator of tests/virtual_device.py:
a torch.distributed tensor collective on a host tensor fails there, as nccl would on a GPU.
Ranks are not daemonic, so a body may start processes of its own (megatron-core's checkpoint writers
do); a rank still running when the test fails or times out is killed. A launch whose free port another
process took before rank 0 bound it (tests run on two workers) runs again once on another port.
"""
from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results, on_virtual_device=False):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch
        torch.set_num_threads(1)
        from hybridrl.parallel import distributed

        distributed.init_distributed(timeout_s=120)
        # gloo's full mesh can be up on one rank while another still connects: a body that returns at once
        # (or fails) would close the pairs under it ("Connection closed by peer" in the other's init)
        torch.distributed.barrier()
        if on_virtual_device:
            from virtual_device import virtual_device

            with virtual_device():
                out = fn(*args)
        else:
            out = fn(*args)
        # Bytes, not tensors: tensors sent through a Queue live in this process's shared memory,
        # which is gone if it exits before the parent has read them.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, including SystemExit from the body
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from hybridrl.parallel import distributed

            distributed.destroy()
        except Exception:
            pass


_PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "transformers", "hybridrl.parallel.distributed"]


def _context():
    # A fork server that imported torch and megatron-core once makes each launch a cheap fork of a
    # process that never ran a parallel region (forking the pytest process itself is not safe).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0, port_tries: int = 2,
                    on_virtual_device: bool = False):
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, on_virtual_device), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs, errors, timed_out = {}, {}, False
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size and not errors:
            try:
                rank, status, payload = results.get(timeout=1.0)
                (outputs if status == "ok" else errors)[rank] = payload
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
            if dead:  # a rank died without reporting (segfault, OOM kill, failed start)
                errors[dead[0]] = f"process exited with code {procs[dead[0]].exitcode} before reporting"
            elif time.monotonic() > deadline:
                timed_out = True
                missing = sorted(set(range(world_size)) - set(outputs))
                raise AssertionError(f"distributed test timed out after {timeout:.0f}s; "
                                     f"ranks {missing} did not finish")
    finally:
        for p in procs:
            p.join(timeout=1 if (errors or timed_out) else 10)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        if port_tries > 1 and "EADDRINUSE" in errors[rank]:  # another process took the free port first
            return run_distributed(fn, world_size, *args, timeout=timeout, port_tries=port_tries - 1,
                                   on_virtual_device=on_virtual_device)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    import torch

    return [torch.load(io.BytesIO(outputs[r]), weights_only=False) for r in range(world_size)]
