"""trainer.logger=[...,wandb]: a real offline W&B run whose files hold every metric and the resolved config,
and one `error:` line when the package is missing."""
import glob
import json
import os
import subprocess
import sys

import pytest

import wandb_files
from test_trainer import ROOT, TINY, _overrides, read_scalars


@pytest.mark.slow
def test_wandb_offline_run_holds_every_metric_and_the_config(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")  # no netrc: not logged in
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
        + _overrides(tmp_path, ["trainer.total_training_steps=3", "trainer.logger=[console,tensorboard,wandb]",
                                "trainer.project_name=proj", "trainer.experiment_name=exp", "actor.optim.lr=2e-3",
                                "trainer.test_freq=3", "trainer.log_val_generations=2"]),
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = glob.glob(str(tmp_path / "tb" / "proj" / "exp" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run under the log dir: {runs}"
    history = wandb_files.history(runs[0])
    scalars = read_scalars(tmp_path)  # the same run's TensorBoard scalars: an independent record
    assert sorted(history) == [1, 2, 3]
    for tag, by_step in scalars.items():
        for step, value in by_step.items():
            assert history[step][tag] == pytest.approx(value, rel=1e-6), (tag, step)
    assert {"actor/pg_loss", "critic/score/mean", "timing_s/gen"} <= set(history[3])
    # verl's trainer.log_val_generations: a table of (step, input_i, output_i, score_i), a row per validation
    row = history[3]
    assert (row["val/generations/_type"], row["val/generations/nrows"], row["val/generations/ncols"]) == ("table-file", 1, 7)
    with open(os.path.join(os.path.dirname(runs[0]), "files", row["val/generations/path"])) as f:
        table = json.load(f)
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"], table
    assert table["data"] == [[3] + _tensorboard_samples(tmp_path, 3)], table  # the same samples TensorBoard holds
    config = wandb_files.config(runs[0])  # the resolved config, override included
    assert config["actor"]["optim"]["lr"] == 2e-3 and config["trainer"]["experiment_name"] == "exp"
    assert config["rollout"]["n"] == 2 and config["data"]["max_response_length"] == 4


def _tensorboard_samples(tmp_path, step: int) -> list:
    """[input_1, output_1, score_1, ...] of the validation generations TensorBoard's text summary shows at `step`."""
    import re

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = glob.glob(os.path.join(str(tmp_path), "tb", "**", "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(path, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = [e for e in acc.Tensors("val/generations/text_summary") if e.step == step]
    text = event.tensor_proto.string_val[0].decode()
    found = re.findall(r"\*\*Input:\*\* (.*)\n\n\*\*Output:\*\* (.*)\n\n\*\*Score:\*\* (.*)", text)
    assert found, text
    return [x for inp, out, score in found for x in (inp, out, float(score))]


def test_wandb_mode_follows_the_login(tmp_path, monkeypatch):
    from hybridrl.metrics import wandb_mode

    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode() == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_wandb_without_the_package_is_one_error_line(tmp_path):
    hide = ("import sys, runpy; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run(
        [sys.executable, "-c", hide, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
        + _overrides(tmp_path, ["trainer.logger=[console,wandb]"]),
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "wandb" in lines[0] and "pip install -e .[wandb]" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
