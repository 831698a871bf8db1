"""Checkpoints on dist_checkpointing (gloo): save at TP 2 x PP 1, resume at TP 1 x PP 2 and at TP 1.

The reference is independent of dist_checkpointing: the actor's weights and both AdamW moments are
gathered to full HF-named tensors by the HF export path (`mcore_to_hf_stream`, checked against
transformers elsewhere) at the saving layout and again at each resuming layout.
"""
import os

import pytest
import torch

from dist_helper import run_distributed
from test_trainer import TINY, _overrides

LAYOUT = {"tp": "parallel.tensor_model_parallel_size", "pp": "parallel.pipeline_model_parallel_size"}


def _trainer(tmp, tp, pp, extra=()):
    from hybridrl.config_io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.roles import build_roles
    from hybridrl.trainer import PPOTrainer
    from hybridrl.trainer_loop import _setup

    cfg = load_config(TINY, _overrides(tmp, [f"{LAYOUT['tp']}={tp}", f"{LAYOUT['pp']}={pp}",
                                             "trainer.total_training_steps=4", *extra]))
    _, tokenizer, layout, groups, loader, _ = _setup(cfg)
    roles = build_roles(cfg, groups, tokenizer, 4)
    trainer = PPOTrainer(cfg, layout, groups, tokenizer, roles, RewardManager(cfg.reward), writer=None)
    trainer.sync_rollout_weights()
    return trainer, loader


def exported(worker, spec, groups) -> dict:
    """{"param|exp_avg|exp_avg_sq/<hf name>": full tensor}: moments exported as if they were weights."""
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream

    out, opt = {}, worker.optimizer
    for what in ("param", "exp_avg", "exp_avg_sq"):
        saved = [(p, p.data) for p in opt.params]
        try:
            if what != "param":
                for p in opt.params:
                    p.data = opt.optimizer.state[p][what]
            out.update({f"{what}/{n}": t.clone() for n, t in mcore_to_hf_stream(worker.engine.module, spec, groups)})
        finally:
            for p, data in saved:
                p.data = data
    steps = {float(opt.optimizer.state[p]["step"]) for p in opt.params}
    return {"tensors": out, "step_count": opt.step_count, "adam_steps": steps}


def _save_at_tp2(tmp):
    from hybridrl.checkpoint import CheckpointManager, CheckpointWriter
    from hybridrl.trainer_loop import _save

    trainer, loader = _trainer(tmp, 2, 1)
    batches = iter(loader)
    for step in (1, 2):
        trainer.train_step(next(batches), step)
    _save(CheckpointWriter(CheckpointManager(os.path.join(tmp, "ckpt"), 2)), trainer, loader, 2)
    return exported(trainer.actor, trainer.roles.spec, trainer.groups)


def _resume_at(tmp, path, tp, pp):
    from hybridrl.trainer_loop import _endless, _resume

    trainer, loader = _trainer(tmp, tp, pp)
    step = _resume(trainer, path, loader)
    state = exported(trainer.actor, trainer.roles.spec, trainer.groups)
    metrics = trainer.train_step(next(_endless(loader)), step + 1)
    return dict(state, step=step, grad_norm=metrics["actor/grad_norm"], data=loader.state_dict())


@pytest.mark.slow
def test_resume_at_other_layouts(tmp_path):
    saved = run_distributed(_save_at_tp2, 2, str(tmp_path / "tp2"), daemon=False)[0]
    path = str(tmp_path / "tp2" / "ckpt" / "global_step_2")
    assert saved["step_count"] == 2 and saved["adam_steps"] == {2.0}
    assert all(t.abs().sum() > 0 for k, t in saved["tensors"].items() if k.startswith("exp_avg_sq/"))
    for name, (tp, pp, world) in {"tp1pp2": (1, 2, 2), "tp1": (1, 1, 1)}.items():
        got = run_distributed(_resume_at, world, str(tmp_path / name), path, tp, pp, daemon=False)[0]
        assert got["step"] == 2 and got["step_count"] == 2 and got["adam_steps"] == {2.0}, name
        assert got["tensors"].keys() == saved["tensors"].keys()
        for key, want in saved["tensors"].items():
            assert torch.equal(got["tensors"][key], want), (name, key)
        assert got["data"]["batch_index"] == 3 and torch.isfinite(torch.tensor(got["grad_norm"])), name
