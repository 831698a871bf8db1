"""The heartbeat thread ends with the run: a process that stops its Heartbeats exits cleanly however often
they beat (a daemon thread left inside the store's C++ call at interpreter exit aborted finished runs:
"terminate called without an active exception", seen once in an EP 2 trainer test)."""
import os
import subprocess
import sys

from dist_helper import free_port

SCRIPT = """
import os, sys, time
import torch.distributed as dist
from hybridrl.parallel.liveness import Heartbeats
dist.init_process_group("gloo", rank=0, world_size=1)
beats = Heartbeats(period_s=0.0)  # beating all the time: exit is sure to find it inside the store
time.sleep(0.2)
beats.close()
print(beats.count > 1, beats._thread.is_alive())
"""


def test_stopped_heartbeats_let_the_process_exit_cleanly(tmp_path):
    for _ in range(5):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=tmp_path,
                              env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == ["True", "False"]
