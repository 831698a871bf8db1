"""The tool-calling demo, briefly: SFT warm-up, then GRPO with multi-turn rollouts through both scripts.

The RL run's own metrics carry the multi-turn checks: the trainer's log-probs over whole trajectories
(tool output included) equal the engine's on the model's tokens (the project's fp32 tolerance, as in
tests/test_rollout_trainer_agreement.py: rollout/logprob_diff_mean <= 1e-5, max <= 1e-4), and the
model keeps calling the tool. A second run at rollout TP 2 over two DP ranks samples the same
trajectories (seeds per prompt, sample and turn; one collective batch per turn).
"""
import math
import os
import re
import subprocess
import sys

import pytest

from dist_helper import free_port
from test_trainer import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu_tools.yaml")


def _paths(tmp, run):
    """Data, demonstrations and the SFT model shared under `tmp`; checkpoints and events under `run`."""
    return [f"data.train_files=[{tmp}/data/train.parquet]", f"data.val_files=[{tmp}/data/test.parquet]",
            f"sft.train_files=[{tmp}/sft/train.parquet]", f"sft.output_dir={tmp}/sft_hf", "trainer.progress_bar=false",
            f"trainer.default_local_dir={run}/ckpt", f"trainer.log_dir={run}/tb", f"sft.default_local_dir={run}/sft_ckpt"]


def _run(script, overrides, nproc=1, timeout=300):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    proc = subprocess.run(launcher + [os.path.join(ROOT, "scripts", script), "--config", CONFIG] + overrides,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """The demo's own SFT warm-up (200 steps), shared by the RL runs of this module."""
    from hybridrl.data.tool_demos import write_demonstrations

    tmp = tmp_path_factory.mktemp("tools")
    write_demonstrations(str(tmp / "held_out.parquet"), n=64, seed=99)
    sft = _run("train_sft.py", _paths(tmp, tmp / "sft") + [f"sft.val_files=[{tmp}/held_out.parquet]", "sft.test_freq=150"])
    assert "sft loss: first 20 steps" in sft and os.path.isfile(tmp / "sft_hf" / "model.safetensors")
    # held-out loss after step 150 and after the last (200), as verl's SFT validation; none in between
    val = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step:(\d+) - .*val/loss:([0-9.e+-]+)", sft)}
    assert sorted(val) == [150, 200] and all(0 < v < 5 for v in val.values()), val
    return tmp


@pytest.mark.slow
def test_sft_then_multi_turn_rl(warm, tmp_path):
    rl = [f"model.path={warm}/sft_hf", "trainer.test_freq=0", "trainer.val_before_train=false"]
    out = _run("train_ppo.py", _paths(warm, tmp_path / "tp1") + rl + ["trainer.total_training_steps=3", "trainer.test_freq=3"])
    assert "mean reward: first 1 steps" in out and "tool calls per trajectory: first 1 steps" in out
    one = read_scalars(tmp_path / "tp1")
    for step in (1, 2, 3):
        assert one["rollout/tool_calls/mean"][step] > 0.5, one["rollout/tool_calls/mean"]
        assert one["rollout/num_turns/mean"][step] > 1.5
        # the project's fp32 agreement tolerance (test_rollout_trainer_agreement): rounding grows with
        # the trajectory's length, an offset across tool output would be O(1)
        assert one["rollout/logprob_diff_mean"][step] <= 1e-5, one["rollout/logprob_diff_mean"]
        assert one["rollout/logprob_diff_max"][step] <= 1e-4, one["rollout/logprob_diff_max"]
        # response lengths count tool output; the loss mask (what entropy averages over) does not
        assert one["response_length/mean"][step] > one["perf/rollout_tokens"][step] / 64
    # validation after the last step: verl's val-aux/num_turns over the val responses, model turns as above
    turns = {k: one[f"val-aux/num_turns/{k}"][3] for k in ("min", "mean", "max")}
    assert 1 <= turns["min"] <= turns["mean"] <= turns["max"] <= 3 and turns["max"] >= 2, turns
    # rollout TP 2 over two DP ranks: the same first step
    _run("train_ppo.py", _paths(warm, tmp_path / "tp2") + rl + ["trainer.total_training_steps=1",
                                                                  "rollout.tensor_model_parallel_size=2"], nproc=2)
    two = read_scalars(tmp_path / "tp2")
    for key in ("rollout/num_turns/mean", "rollout/tool_calls/mean", "rollout/tool_errors/mean", "critic/score/mean",
                "response_length/mean", "perf/rollout_tokens"):
        assert two[key][1] == pytest.approx(one[key][1], abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("estimator,tp", [("gae", 2), ("reinforce_plus_plus", 1), ("remax", 1)])
def test_multi_turn_trains_with_every_estimator(warm, tmp_path, estimator, tp):
    """The advantage estimators whose path differs on trajectories with tool output in them update on them (GRPO
    above): PPO with its critic at training TP 2 (values over a mask with holes), REINFORCE++ (returns summed
    over a mask with holes), ReMax (a greedy multi-turn baseline rollout). RLOO and REINFORCE++-baseline share
    GRPO's path here (one score per row, spread over the mask)."""
    _run("train_ppo.py", _paths(warm, tmp_path) + [f"model.path={warm}/sft_hf", f"algorithm.adv_estimator={estimator}",
                                                   f"parallel.tensor_model_parallel_size={tp}", "trainer.test_freq=0",
                                                   "trainer.val_before_train=false", "trainer.total_training_steps=2"],
         nproc=tp)
    scalars = read_scalars(tmp_path)
    for step in (1, 2):
        assert scalars["rollout/num_turns/mean"][step] > 1.5  # tool output inside the trained responses
        assert scalars["actor/grad_norm"][step] > 0 and math.isfinite(scalars["actor/pg_loss"][step])
    if estimator == "gae":  # the critic learns over the same mask with holes
        assert math.isfinite(scalars["critic/vf_loss"][2]) and scalars["critic/grad_norm"][1] > 0
