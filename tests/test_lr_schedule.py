"""The LR schedule moves once per training step (as verl steps its scheduler), not once per optimizer
step: with two mini-batches per step, both optimizer steps of training step t use lr_at(t - 1)."""
import pytest

from dist_helper import run_distributed
from test_trainer import TINY, _overrides, _train, read_scalars


@pytest.mark.slow
def test_two_mini_batches_per_step_share_the_step_lr(tmp_path):
    from hybridrl.config.io import load_config
    from hybridrl.workers.optim import lr_at

    extra = ["trainer.total_training_steps=4", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-3",
             "actor.optim.lr_decay_style=cosine", "actor.optim.min_lr_ratio=0.1"]
    run_distributed(_train, 1, TINY, _overrides(tmp_path, extra))
    logged = read_scalars(tmp_path)["actor/lr"]
    optim = load_config(TINY, _overrides(tmp_path, extra)).actor.optim
    expected = {t: lr_at(t - 1, optim, 4) for t in range(1, 5)}
    assert len(set(expected.values())) == 4  # four points along the cosine
    for t in range(1, 5):
        assert logged[t] == pytest.approx(expected[t], rel=1e-6), (t, logged, expected)
