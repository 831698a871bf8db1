"""SFT checkpoints: periodic saves, a stop that saves and exits 75, and a resume that ends where an uninterrupted
run ends (same weights, bit for bit: the data position, optimizer, LR schedule and RNG streams all restored);
an RL run and an SFT run refuse each other's checkpoints by name. With data.seed null the drawn seed rides in the
checkpoint."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from hybridrl.checkpoint import CheckpointError, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu_tools.yaml")
STEPS = 4


def _sft(tmp, run, *extra):
    """scripts/train_sft.py over the shared demonstrations of `tmp`, its checkpoints and HF folder under `run`."""
    overrides = [f"sft.train_files=[{tmp}/demo.parquet]", "sft.train_batch_size=8", "sft.micro_batch_size_per_gpu=4",
                 "sft.max_length=128", f"sft.total_training_steps={STEPS}", "sft.optim.lr=1e-3",
                 f"sft.default_local_dir={run}/ckpt", f"sft.output_dir={run}/hf",
                 f"trainer.default_local_dir={tmp}/init",
                 f"trainer.log_dir={run}/tb", "trainer.logger=[console]", *extra]
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_sft.py"), "--config", CONFIG]
                          + overrides, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _steps_logged(stdout: str) -> list:
    return [int(line.split("step:")[1].split()[0]) for line in stdout.splitlines() if line.startswith("step:")]


def test_a_stopped_sft_run_resumes_to_the_uninterrupted_weights(tmp_path):
    """The stopped run draws its shuffle seed (data.seed null, verl's default) and saves it with its data position;
    the resumed run goes on with that seed, so it ends with the weights of an uninterrupted run given that seed."""
    from hybridrl.data.tool_demos import write_demonstrations

    write_demonstrations(str(tmp_path / "demo.parquet"), n=24, seed=3)  # 3 batches an epoch: step 4 is epoch 2
    # a stop file already there: the run saves at its first step and exits 75 without the HF folder
    stopped = tmp_path / "stopped"
    os.makedirs(stopped / "ckpt")
    (stopped / "ckpt" / "STOP").touch()
    first = _sft(tmp_path, stopped, "data.seed=null")
    assert first.returncode == 75, first.stdout[-2000:] + first.stderr[-3000:]
    assert "saved on signal at step 1" in first.stdout and _steps_logged(first.stdout) == [1]
    assert (stopped / "ckpt" / "STOPPED").read_text().startswith("step 1")
    assert not os.path.exists(stopped / "hf")
    seed = json.loads((stopped / "ckpt" / "global_step_1" / "meta.json").read_text())["data"]["seed"]
    # the same command goes on from step 2 (the stop file was served by that save) to the same weights
    second = _sft(tmp_path, stopped, "data.seed=null")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert f"resumed from {stopped}/ckpt/global_step_1 at step 1" in second.stdout
    assert _steps_logged(second.stdout) == [2, 3, 4]
    assert not os.path.exists(stopped / "ckpt" / "STOP") and not os.path.exists(stopped / "ckpt" / "STOPPED")
    whole = _sft(tmp_path, tmp_path / "whole", "sft.save_freq=2", f"data.seed={seed}")
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-3000:]
    assert _steps_logged(whole.stdout) == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "whole" / "ckpt")) == ["global_step_2", "global_step_4",
                                                               "latest_checkpointed_iteration.txt"]
    expected = load_file(tmp_path / "whole" / "hf" / "model.safetensors")
    got = load_file(stopped / "hf" / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:  # other batches (a restart from batch 0, another seed), fresh Adam moments or step count
        assert (expected[name] == got[name]).all(), name  # would differ


@pytest.mark.parametrize("saved, resuming, fragment", [("sft", "rl", "is an SFT checkpoint"),
                                                      ("rl", "sft", "is an RL checkpoint, not an SFT one")])
def test_rl_and_sft_refuse_each_others_checkpoints(tmp_path, saved, resuming, fragment):
    meta = {"step": 1, "roles": ["actor"], "data": {}, "layout": {}, "hf_config": {}, "kl_coef": 0.0}
    if saved == "sft":
        meta["run"] = "sft"
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=fragment):
        load_checkpoint(str(tmp_path), {}, {}, run=resuming)
