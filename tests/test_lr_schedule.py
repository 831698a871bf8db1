"""The LR schedule: `lr_at` by hand and against megatron-core's own OptimizerParamScheduler (what verl 0.9.1's
Megatron workers step: linear warmup from lr_warmup_init at the first update, then constant, linear or cosine
decay to lr * min_lr_ratio at the run's last step), and it moves once per training step (as verl steps its
scheduler), not once per optimizer step; `actor/lr` is logged after that move, as verl 0.9.1 logs it."""
import math

import pytest

from dist_helper import run_distributed
from test_trainer import TINY, _overrides, _train, read_scalars


# warmup 4 steps from 0, 12 in all, peak 2.0, floor 0.1 * 2.0: decay runs over steps 4..12 (progress (t - 4) / 8)
HAND = {
    "constant": {0: 0.0, 1: 0.5, 3: 1.5, 4: 2.0, 11: 2.0, 40: 2.0},
    "linear": {0: 0.0, 2: 1.0, 3: 1.5, 4: 2.0, 6: 0.2 + 1.8 * 0.75, 8: 0.2 + 1.8 * 0.5, 11: 0.2 + 1.8 * 0.125,
               12: 0.2, 40: 0.2},
    "cosine": {0: 0.0, 3: 1.5, 4: 2.0, 6: 0.2 + 0.9 * (1 + math.sqrt(0.5)), 8: 0.2 + 0.9,
               10: 0.2 + 0.9 * (1 - math.sqrt(0.5)), 12: 0.2, 40: 0.2},
}


@pytest.mark.parametrize("style", sorted(HAND))
def test_lr_at_by_hand(style):
    from hybridrl.config import OptimConfig
    from hybridrl.workers.optim import lr_at

    cfg = OptimConfig(lr=2.0, lr_warmup_steps=4, lr_decay_style=style, min_lr_ratio=0.1)
    for step, expected in HAND[style].items():
        assert lr_at(step, cfg, 12) == pytest.approx(expected, rel=1e-12), (style, step)


def test_lr_at_edges_by_hand():
    from hybridrl.config import OptimConfig
    from hybridrl.workers.optim import lr_at

    cosine = OptimConfig(lr=1.0, lr_decay_style="cosine")  # no warmup, floor 0: the full half cosine
    assert [lr_at(t, cosine, 4) for t in range(5)] == pytest.approx([1.0, 0.5 + 0.5 * math.sqrt(0.5), 0.5,
                                                                     0.5 - 0.5 * math.sqrt(0.5), 0.0], abs=1e-12)
    one = OptimConfig(lr=1.0, lr_warmup_steps=1)  # one warmup update, at lr_warmup_init, then the peak
    assert [lr_at(t, one, 10) for t in range(3)] == [0.0, 1.0, 1.0]
    # a run no longer than its warmup stays at the peak once warmed up, whatever the decay style
    short = OptimConfig(lr=1.0, lr_warmup_steps=4, lr_decay_style="linear", min_lr_ratio=0.5)
    assert [lr_at(t, short, 3) for t in range(6)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
    # lr_warmup_steps <= 0: a share of the run's steps (verl's lr_warmup_steps_ratio), int(0.25 * 10) = 2
    ratio = OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.25, lr_warmup_init=0.1)
    assert [lr_at(t, ratio, 10) for t in range(4)] == pytest.approx([0.1, 0.55, 1.0, 1.0])


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,init", [(0, 0.0), (3, 0.0), (3, 0.25)])
def test_lr_at_is_megatrons_scheduler(style, warmup, init):
    """What megatron-core's OptimizerParamScheduler sets before update t (it starts at step 0 and steps once after
    each update, lr_decay_steps the run's length, min_lr lr * min_lr_ratio), as verl 0.9.1's Megatron workers use it."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hybridrl.config import OptimConfig
    from hybridrl.workers.optim import lr_at

    total, lr = 10, 2.0
    cfg = OptimConfig(lr=lr, lr_warmup_steps=warmup, lr_warmup_init=init, lr_decay_style=style, min_lr_ratio=0.1)
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    megatron = OptimizerParamScheduler(sgd, init_lr=init, max_lr=lr, min_lr=lr * 0.1, lr_warmup_steps=warmup,
                                       lr_decay_steps=total, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=total, wd_incr_style="constant")
    for t in range(total + 1):
        assert lr_at(t, cfg, total) == pytest.approx(sgd.param_groups[0]["lr"], rel=1e-12, abs=1e-15), (t, style)
        megatron.step(1)


@pytest.mark.slow
def test_two_mini_batches_per_step_share_the_step_lr(tmp_path):
    from hybridrl.config.io import load_config
    from hybridrl.workers.optim import lr_at

    extra = ["trainer.total_training_steps=4", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-3",
             "actor.optim.lr_decay_style=cosine", "actor.optim.min_lr_ratio=0.1"]
    run_distributed(_train, 1, TINY, _overrides(tmp_path, extra))
    logged = read_scalars(tmp_path)["actor/lr"]
    optim = load_config(TINY, _overrides(tmp_path, extra)).actor.optim
    expected = {t: lr_at(t, optim, 4) for t in range(1, 5)}  # logged after step t's one move (verl 0.9.1)
    assert len(set(expected.values())) == 4  # four points along the cosine
    for t in range(1, 5):
        assert logged[t] == pytest.approx(expected[t], rel=1e-6), (t, logged, expected)
