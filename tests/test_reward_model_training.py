"""scripts/train_rm.py and the two-command demo of configs/tiny_cpu_rm.yaml, briefly: the Bradley-Terry
loss by hand; a PP=2 training whose saved HF folder transformers loads and scores as the run did; then
PPO against it (dry run with the reward-model phase, a short run with critic/rm_score and the val trend)."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from dist_helper import free_port
from test_trainer import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RM = os.path.join(ROOT, "configs", "tiny_cpu_rm.yaml")
RM_STEPS = 40
RM_FAST = [f"reward_model.train.steps={RM_STEPS}", "reward_model.train.num_pairs=512",
           "reward_model.train.num_val_pairs=64", "reward_model.train.val_freq=20",
           "reward_model.train.batch_size=32", "reward_model.train.micro_batch_size_per_gpu=16",
           "reward_model.train.optim.lr_warmup_steps=0"]
PPO_FAST = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
            "data.val_batch_size=32", "trainer.total_training_steps=4", "trainer.test_freq=2",
            "trainer.progress_bar=false", "reward_model.offload_params=true"]


def test_bradley_terry_loss_by_hand():
    from hybridrl.reward_model.training import _bradley_terry, pair_margins, pair_micro_batches

    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4], [5, 6, 0]])  # chosen 0,1 then rejected 0,1
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 0]])
    pairs = {"chosen_ids": ids[:2], "chosen_mask": mask[:2], "rejected_ids": ids[2:], "rejected_mask": mask[2:]}
    (mb,) = pair_micro_batches(pairs, micro_pairs=2, pad_id=0)
    assert torch.equal(mb["input_ids"], ids) and mb["score_index"].tolist() == [2, 2, 2, 1]
    values = torch.tensor([[9.0, 9.0, 1.5], [9.0, 9.0, -0.5], [9.0, 9.0, 0.5], [9.0, 2.0, 9.0]])
    margins = [1.5 - 0.5, -0.5 - 2.0]
    assert pair_margins(values, mb).tolist() == margins
    total, n_micro, dp = 8, 2, 2  # this micro batch holds 2 of the step's 8 pairs
    loss, stats = _bradley_terry(values, mb, total, n_micro, dp)
    by_hand = sum(math.log1p(math.exp(-m)) for m in margins)  # -log sigmoid(m)
    assert loss.item() == pytest.approx(by_hand / total * n_micro * dp, rel=1e-6)
    assert stats["reward_model/loss"] == pytest.approx(by_hand / total, rel=1e-6)
    assert stats["reward_model/acc"] == 1 / total and stats["reward_model/margin"] == pytest.approx(sum(margins) / total)


def _run(cmd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _transformers_val_accuracy(overrides, rm_path) -> float:
    """Held-out preference accuracy of the saved folder, scored by transformers (the independent reference)."""
    import transformers

    from hybridrl.config.io import load_config
    from hybridrl.data.prompts import make_train_loader, make_val_loader
    from hybridrl.reward_model.training import _pair_sets
    from hybridrl.tokenizer import load_tokenizer

    cfg = load_config(TINY_RM, overrides)
    tok = load_tokenizer(cfg.data.tokenizer)
    rows = [make_train_loader(cfg.data, tok, 0, 1).dataset.rows, make_val_loader(cfg.data, tok, 0, 1).dataset.rows]
    _, val = _pair_sets(cfg, tok, *rows, tok.pad_token_id)
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(rm_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.architectures == ["Qwen2ForSequenceClassification"]
    with torch.no_grad():
        scores = {side: model(input_ids=val[f"{side}_ids"], attention_mask=val[f"{side}_mask"]).logits[:, 0]
                  for side in ("chosen", "rejected")}
    return (scores["chosen"] > scores["rejected"]).float().mean().item()


@pytest.mark.slow
def test_train_rm_at_pp2_then_ppo_against_it(tmp_path):
    files = [f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/test.parquet]",
             f"reward_model.path={tmp_path}/rm", f"trainer.default_local_dir={tmp_path}/ckpt",
             f"trainer.log_dir={tmp_path}/tb"]
    train_rm = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                os.path.join(ROOT, "scripts", "train_rm.py"), "--config", TINY_RM]
    out = _run(train_rm + files + RM_FAST + ["parallel.pipeline_model_parallel_size=2"])
    trend = re.search(r"held-out preference accuracy: ([\d.]+) \(step 0\) -> ([\d.]+) \(step 20\) -> ([\d.]+) "
                      rf"\(step {RM_STEPS}\)", out)
    assert trend, out[-2000:]
    assert float(trend[3]) > float(trend[1]) + 0.1, trend[0]
    # the saved folder scores the held-out pairs in transformers as the megatron run did (ties aside)
    assert abs(_transformers_val_accuracy(files + RM_FAST, f"{tmp_path}/rm") - float(trend[3])) <= 1 / 64 + 1e-6

    ppo = [sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY_RM] + files + PPO_FAST
    dry = _run(ppo + ["--dry-run"])
    for fragment in ("critic/rm_score/mean", "reward model (pipeline stage 0)", "reward_model/weights",
                     "Ready for real training"):
        assert fragment in dry, fragment
    out = _run(ppo)
    assert re.search(r"val-core/synthetic/arith/acc/mean@1: [\d.]+ \(step 0\) -> [\d.]+ \(step 2\) -> [\d.]+ \(step 4\)", out), out
    scalars = read_scalars(tmp_path)
    assert set(scalars["critic/rm_score/mean"]) == {1, 2, 3, 4}
    for step in (1, 4):  # combine=replace: the training score is the reward model's
        assert scalars["critic/score/mean"][step] == pytest.approx(scalars["critic/rm_score/mean"][step], abs=1e-6)
