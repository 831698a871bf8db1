"""Checkpoint folders: atomic publication, keep-last-K, pointer, partial folders never taken; a run
SIGKILLed in the middle of a save; every bad resume input ends in one `error:` line of train_ppo.py."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridrl.checkpoint import CheckpointError, CheckpointManager, read_meta, rng_state, set_rng_state
from hybridrl.checkpoint.folders import POINTER, check_step_folder
from test_trainer import ROOT, TINY, _overrides

SCRIPT = os.path.join(ROOT, "scripts", "train_ppo.py")


def _publish(ckpt, step):
    tmp = ckpt.prepare(step)
    open(os.path.join(tmp, "shard"), "w").write(str(step))
    return ckpt.publish(step, {"data": {"batch_index": step}})


def test_publish_prune_pointer_and_partial_folders(tmp_path):
    ckpt = CheckpointManager(str(tmp_path), keep=2)
    for step in (2, 4, 6):
        _publish(ckpt, step)
    assert sorted(ckpt.complete_steps()) == [4, 6] and ckpt.latest().endswith("global_step_6")
    assert read_meta(ckpt.latest()) == {"data": {"batch_index": 6}, "step": 6}
    # a killed save's folder, a step folder without meta.json and a pointer past them are never taken
    os.makedirs(tmp_path / "global_step_8.tmp")
    os.makedirs(tmp_path / "global_step_9")
    (tmp_path / POINTER).write_text("9")
    assert ckpt.latest().endswith("global_step_6") and 9 not in ckpt.complete_steps()
    _publish(ckpt, 6)  # re-saving a step replaces it whole; leftovers of killed saves go
    assert not os.path.exists(tmp_path / "global_step_8.tmp") and (tmp_path / POINTER).read_text() == "6"
    assert ckpt.resolve("disable") is None and ckpt.resolve("auto").endswith("global_step_6")
    assert ckpt.resolve(str(tmp_path / "global_step_4")).endswith("global_step_4")


def test_resume_path_messages(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "root"), keep=2)
    _publish(ckpt, 3)
    os.makedirs(tmp_path / "root" / "global_step_5.tmp")
    cases = {str(tmp_path / "nope"): "no such folder", str(tmp_path / "root"): "checkpoint root, not one checkpoint; "
             f"pass {tmp_path / 'root' / 'global_step_3'}", str(tmp_path / "root" / "global_step_5.tmp"):
             "not a complete checkpoint (no meta.json; an interrupted save)", str(tmp_path): "not a complete checkpoint"}
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_step_folder(path)


def test_unreadable_or_foreign_meta(tmp_path):
    from hybridrl.checkpoint import load_checkpoint
    from hybridrl.checkpoint.writer import RUN_KEYS

    ckpt = CheckpointManager(str(tmp_path), keep=3)
    torn, old, grpo = (ckpt.step_dir(s) for s in (1, 2, 3))
    for path, meta in ((torn, '{"step": 1, "da'), (old, json.dumps({"step": 2, "data": {}, "kl_coef": 0.0})),
                       (grpo, json.dumps({**{k: 0 for k in RUN_KEYS}, "roles": ["actor"], "layout": {}}))):
        os.makedirs(path)
        open(os.path.join(path, "meta.json"), "w").write(meta)
    with pytest.raises(CheckpointError, match=r"global_step_1/meta.json cannot be read \(Unterminated string"):
        load_checkpoint(torn, {}, {})
    with pytest.raises(CheckpointError, match="lacks roles, layout, hf_config.*trainer.resume_mode=disable"):
        load_checkpoint(old, {}, {})
    with pytest.raises(CheckpointError, match="has no critic state.*algorithm.adv_estimator it was saved with"):
        load_checkpoint(grpo, {"critic": None}, {})


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def _script(tmp, extra, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, "--config", TINY] + _overrides(tmp, ["trainer.logger=[console]"] + extra),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, start_new_session=True)


def _one_error(proc, *fragments):
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# Runs in the training process: SIGKILL the whole process group (the trainer and megatron's writer
# helpers, as when a node dies) once step 2's actor shards are on disk, before meta.json and the rename.
KILL_IN_SAVE = textwrap.dedent("""
    import os, signal, sys
    from hybridrl.checkpoint import writer
    real = writer.save_role
    def save_then_die(worker, folder, is_async):
        out = real(worker, folder, is_async)
        if "global_step_2.tmp" in folder:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return out
    writer.save_role = save_then_die
    from hybridrl.trainer.entry import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_killed_mid_save_then_auto_resume_and_bad_inputs(tmp_path):
    args = ["--config", TINY] + _overrides(tmp_path, ["trainer.logger=[console]", "trainer.total_training_steps=3",
                                                      "trainer.save_freq=1", "algorithm.adv_estimator=gae"])
    proc = subprocess.run([sys.executable, "-c", KILL_IN_SAVE] + args, capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    root = tmp_path / "ckpt"
    assert os.listdir(root / "global_step_2.tmp" / "actor") and not (root / "global_step_2.tmp" / "meta.json").exists()
    assert CheckpointManager(str(root), 2).latest().endswith("global_step_1")
    resumed = _script(tmp_path, ["trainer.total_training_steps=2", "trainer.save_freq=1", "algorithm.adv_estimator=gae"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {root / 'global_step_1'} at step 1" in resumed.stdout
    assert sorted(CheckpointManager(str(root), 2).complete_steps()) == [1, 2]
    assert not (root / "global_step_2.tmp").exists() and read_meta(str(root / "global_step_2"))["roles"] == ["actor", "critic"]
    # bad resume inputs through the script (the path checks before any model is built, then the load):
    # one `error:` line naming the problem and the fix; test_resume_path_messages has the other folders
    _one_error(_script(tmp_path / "a", [f"trainer.resume_mode={tmp_path}/no/such"]), "no such folder", "auto")
    _one_error(_script(tmp_path / "c", [f"trainer.resume_mode={root / 'global_step_2'}", "model.intermediate_size=96",
                                        "algorithm.adv_estimator=gae"]),
               "'decoder.layers.mlp.linear_fc1.weight' with shape [2, 256, 64], this model's is [2, 192, 64]",
               "model.* settings")
