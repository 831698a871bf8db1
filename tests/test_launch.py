"""How a run binds its rendezvous port: a single-process run takes a free port unless MASTER_PORT is set,
and a busy MASTER_PORT ends in one `error:` line naming the port and the fix."""
import os
import socket
import subprocess
import sys

from hybridrl.parallel.distributed import launch_env
from test_trainer import ROOT, TINY, _overrides


def test_single_process_takes_a_free_port_unless_one_is_given():
    ports = {launch_env({}).master_port for _ in range(3)}
    assert 29500 not in ports or len(ports) > 1  # not a fixed default
    for port in ports:
        with socket.socket() as s:  # nothing listens there: it can be bound
            s.bind(("127.0.0.1", port))
    assert launch_env({"MASTER_PORT": "31234"}).master_port == 31234


def test_a_busy_master_port_is_one_error_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "MASTER_PORT": str(port)}
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
                              + _overrides(tmp_path, []), capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"MASTER_PORT={port}" in errors[0] and "free port" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_single_process_run_takes_another_port_when_its_choice_is_taken(tmp_path):
    """Between choosing a free port and binding it another process may take it (two test workers starting
    runs side by side did): the run takes another free port instead of failing."""
    code = (
        "import os, socket\n"
        "import torch.distributed as dist\n"
        "from hybridrl.parallel import distributed\n"
        "busy = socket.socket(); busy.bind(('127.0.0.1', 0)); busy.listen()\n"
        "taken, real = [busy.getsockname()[1]], distributed.free_port\n"
        "distributed.free_port = lambda: taken.pop() if taken else real()\n"
        "le = distributed.init_distributed(timeout_s=30)\n"
        "print(dist.is_initialized(), le.master_port != busy.getsockname()[1],\n"
        "      os.environ['MASTER_PORT'] == str(le.master_port))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT") and not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True", "True"]
