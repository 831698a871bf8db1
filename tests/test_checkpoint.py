"""Atomic checkpoints: keep-last-K, resume resolution, and a process killed mid-write."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridrl.checkpoint import CheckpointManager, rng_state, set_rng_state


def test_save_load_prune_and_pointer(tmp_path):
    ckpt = CheckpointManager(str(tmp_path), keep=2, rank=0)
    for step in (2, 4, 6):
        ckpt.save(step, {"w": torch.full((3,), float(step))}, {"data": {"epoch": 0, "batch_index": step}})
    assert sorted(ckpt.complete_steps()) == [4, 6]
    assert ckpt.latest().endswith("global_step_6")
    state, meta = ckpt.load(ckpt.latest())
    assert torch.equal(state["w"], torch.full((3,), 6.0)) and meta["step"] == 6 and meta["data"]["batch_index"] == 6
    assert ckpt.resolve("disable") is None
    assert ckpt.resolve(str(tmp_path / "global_step_4")).endswith("global_step_4")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.resolve(str(tmp_path / "nope"))


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    from hybridrl.checkpoint import CheckpointManager
    ckpt = CheckpointManager(sys.argv[1], keep=3, rank=0)
    ckpt.save(4, {"w": torch.ones(4)}, {"data": {}})
    real_save = torch.save
    def dying_save(obj, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save = dying_save
    ckpt.save(8, {"w": torch.zeros(4)}, {"data": {}})
""")


def test_killed_during_write_keeps_previous(tmp_path):
    root = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", KILLER, root], capture_output=True, timeout=120)
    assert proc.returncode != 0  # killed by SIGKILL
    assert os.path.isdir(os.path.join(root, "global_step_8.tmp"))
    ckpt = CheckpointManager(root, keep=3, rank=0)
    assert ckpt.latest().endswith("global_step_4")
    state, meta = ckpt.load(ckpt.latest())
    assert torch.equal(state["w"], torch.ones(4)) and meta["step"] == 4
    ckpt.save(5, {"w": torch.ones(4)}, {"data": {}})
    assert not os.path.exists(os.path.join(root, "global_step_8.tmp"))
