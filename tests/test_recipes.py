"""The algorithm recipes in configs/recipes/ (DAPO, Dr. GRPO, GSPO): each sets verl's keys of its
algorithm, and the DAPO recipe runs on CPU with dynamic sampling, overlong shaping, validation only at
the end (trainer.test_freq = the steps) and a console line every trainer.log_freq steps."""
import os
import re
import subprocess
import sys

import pytest

from test_trainer import ROOT, _overrides, read_scalars

from hybridrl.config.io import load_config

RECIPES = os.path.join(ROOT, "configs", "recipes")


def test_recipes_set_their_algorithm():
    dapo = load_config(os.path.join(RECIPES, "dapo_tiny_cpu.yaml"))
    assert dapo.algorithm.filter_groups.enable and dapo.algorithm.filter_groups.max_num_gen_batches > 0
    assert dapo.reward.overlong_buffer.enable and 0 < dapo.reward.overlong_buffer.len < dapo.data.max_response_length
    assert dapo.actor.clip_ratio_high > dapo.actor.clip_ratio_low and dapo.actor.loss_agg_mode == "token-mean"
    assert not dapo.actor.use_kl_loss and not dapo.algorithm.use_kl_in_reward
    dr = load_config(os.path.join(RECIPES, "dr_grpo_tiny_cpu.yaml"))
    assert dr.algorithm.adv_estimator == "grpo" and not dr.algorithm.norm_adv_by_std_in_grpo
    assert dr.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    gspo = load_config(os.path.join(RECIPES, "gspo_tiny_cpu.yaml"))
    assert gspo.actor.policy_loss.loss_mode == "gspo" and gspo.actor.loss_agg_mode == "seq-mean-token-mean"
    assert gspo.actor.clip_ratio_low < 1e-2 and gspo.actor.clip_ratio_high < 1e-2


@pytest.mark.slow
def test_dapo_recipe_runs_on_cpu_and_validates_only_at_the_end(tmp_path):
    steps = 4
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config",
           os.path.join(RECIPES, "dapo_tiny_cpu.yaml")] + _overrides(tmp_path, [
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.log_freq=3",
        "data.val_batch_size=8", "reward.overlong_buffer.len=2", "algorithm.filter_groups.max_num_gen_batches=20",
        f"trainer.rollout_data_dir={tmp_path}/rollouts", f"trainer.validation_data_dir={tmp_path}/val",
        "trainer.logger=[console,tensorboard,file]"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scalars = read_scalars(tmp_path)
    assert sorted(scalars["train/num_gen_batches"]) == list(range(1, steps + 1))
    assert all(v >= 1 for v in scalars["train/num_gen_batches"].values())
    assert all(0 < v <= 1 for v in scalars["train/filter_groups/kept_ratio"].values())
    assert sorted(scalars["val-core/synthetic/arith/acc/mean@1"]) == [steps]  # -1: only after the last step
    assert re.findall(r"^step:(\d+) ", proc.stdout, re.M) == ["3", "4"]  # every log_freq steps and the last
    _check_generation_dumps(tmp_path, steps, scalars)
    import json  # verl's file logger: every step's metrics, the TensorBoard scalars' values
    (path,) = list((tmp_path / "tb").glob("**/metrics.jsonl"))
    logged = {}  # a step may log twice (its update, then its validation): one line each
    for line in map(json.loads, path.read_text().splitlines()):
        logged.setdefault(line["step"], {}).update(line["data"])
    assert sorted(logged) == list(range(1, steps + 1))
    assert [logged[s]["training/epoch"] for s in logged] == [0] * steps  # verl's: the first pass over the data
    for key in ("critic/score/mean", "actor/pg_loss", "train/num_gen_batches"):
        assert all(abs(logged[s][key] - scalars[key][s]) <= 1e-6 * max(1, abs(scalars[key][s])) for s in logged), key


def _check_generation_dumps(tmp_path, steps, scalars):
    """verl's trainer.rollout_data_dir / validation_data_dir: <step>.jsonl of the batch the step trained on (the
    groups dynamic sampling kept: their mean score is the step's critic/score/mean), each line its prompt, response,
    ground truth (the prompt's own sum), score, step and the reward's extra values; validation's mean acc is the
    logged val-core acc."""
    import json

    def lines(path):
        with open(path) as f:
            return [json.loads(line) for line in f]

    assert sorted(os.listdir(tmp_path / "rollouts")) == [f"{s}.jsonl" for s in range(1, steps + 1)]
    for step in range(1, steps + 1):
        rows = lines(tmp_path / "rollouts" / f"{step}.jsonl")
        assert len(rows) == 4 * 2 and {r["step"] for r in rows} == {step}
        assert all(r["gts"] == str(eval(r["input"].removesuffix("="))) for r in rows)  # a+b= and its sum
        assert all(rows[i]["input"] == rows[i + 1]["input"] for i in range(0, len(rows), 2))  # a group per prompt
        assert {"acc", "pred"} <= set(rows[0]) and all(isinstance(r["output"], str) for r in rows)
        assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(scalars["critic/score/mean"][step], abs=1e-6)
    assert os.listdir(tmp_path / "val") == [f"{steps}.jsonl"]  # validated only after the last step
    val = lines(tmp_path / "val" / f"{steps}.jsonl")
    assert all(r["gts"] == str(eval(r["input"].removesuffix("="))) for r in val)
    assert sum(r["acc"] for r in val) / len(val) == pytest.approx(scalars["val-core/synthetic/arith/acc/mean@1"][steps])


def test_rollout_correction_recipes_are_verls_presets():
    """configs/recipes/rollout_correction/: one fragment per factory preset of verl 0.9.1's
    RolloutCorrectionConfig (read from the reference data its generator wrote with verl), with its values."""
    import json

    with open(os.path.join(ROOT, "tests", "verl_reference", "rollout_correction_verl_0_9_1.json")) as f:
        presets = json.load(f)["presets"]
    folder = os.path.join(RECIPES, "rollout_correction")
    assert sorted(os.listdir(folder)) == sorted(f"{name}.yaml" for name in presets)
    for name, fields in presets.items():
        cfg = load_config(f"{os.path.join(ROOT, 'configs', 'tiny_cpu.yaml')},{os.path.join(folder, name + '.yaml')}")
        got = cfg.algorithm.rollout_correction
        assert {k: getattr(got, k) for k in fields} == fields, name
