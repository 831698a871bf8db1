"""Checkpoints on dist_checkpointing (gloo): save at TP 2 x PP 1, resume at TP 1 x PP 2 and at TP 1.

The reference is independent of dist_checkpointing: the actor's weights and both AdamW moments are
gathered to full HF-named tensors by the HF export path (`mcore_to_hf_stream`, checked against
transformers elsewhere) at the saving layout and again at each resuming layout.
"""
import os
import shutil

import pytest
import torch

from dist_helper import run_distributed
from test_trainer import TINY, _overrides

LAYOUT = {"tp": "parallel.tensor_model_parallel_size", "pp": "parallel.pipeline_model_parallel_size"}


def _trainer(tmp, tp, pp, extra=()):
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.loop import setup_run

    cfg = load_config(TINY, _overrides(tmp, [f"{LAYOUT['tp']}={tp}", f"{LAYOUT['pp']}={pp}",
                                             "trainer.total_training_steps=4", *extra]))
    _, tokenizer, layout, groups, loader, _ = setup_run(cfg)
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
    from hybridrl.trainer.loop import _save

    trainer, loader = _trainer(tmp, 2, 1)
    batches = iter(loader)
    for step in (1, 2):
        trainer.train_step(next(batches), step)
    _save(CheckpointWriter(CheckpointManager(os.path.join(tmp, "ckpt"), 2)), trainer, loader.state_dict(), 2)
    return exported(trainer.actor, trainer.roles.spec, trainer.groups)


def _resume_at(tmp, path, tp, pp):
    """Resume, export, run one step and save it (the step's checkpoint goes under tmp/ckpt)."""
    from hybridrl.checkpoint import CheckpointManager, CheckpointWriter
    from hybridrl.trainer.loop import _resume, _save
    from hybridrl.trainer.prompt_feed import endless

    trainer, loader = _trainer(tmp, tp, pp)
    step = _resume(trainer, path, loader)
    state = exported(trainer.actor, trainer.roles.spec, trainer.groups)
    metrics = trainer.train_step(next(endless(loader)), step + 1)
    _save(CheckpointWriter(CheckpointManager(os.path.join(tmp, "ckpt"), 1)), trainer, loader.state_dict(), step + 1)
    return dict(state, step=step, grad_norm=metrics["actor/grad_norm"], data=loader.state_dict())


def _bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@pytest.mark.slow
def test_resume_at_other_layouts(tmp_path):
    saved = run_distributed(_save_at_tp2, 2, str(tmp_path / "tp2"))[0]
    path = str(tmp_path / "tp2" / "ckpt" / "global_step_2")
    assert saved["step_count"] == 2 and saved["adam_steps"] == {2.0}
    assert all(t.abs().sum() > 0 for k, t in saved["tensors"].items() if k.startswith("exp_avg_sq/"))
    for name, (tp, pp, world) in {"tp1pp2": (1, 2, 2), "tp1": (1, 1, 1), "dp2": (1, 1, 2)}.items():
        got = run_distributed(_resume_at, world, str(tmp_path / name), path, tp, pp)[0]
        assert got["step"] == 2 and got["step_count"] == 2 and got["adam_steps"] == {2.0}, name
        assert got["tensors"].keys() == saved["tensors"].keys()
        for key, want in saved["tensors"].items():
            assert torch.equal(got["tensors"][key], want), (name, key)
        assert got["data"]["batch_index"] == 3 and torch.isfinite(torch.tensor(got["grad_norm"])), name
    # one copy of each shard whatever DP: the DP 2 save is no larger than the TP 1 one (a copy per
    # replica would double it)
    one, two = (_bytes(tmp_path / name / "ckpt" / "global_step_3" / "actor") for name in ("tp1", "dp2"))
    assert 0.9 < two / one < 1.1, (one, two)


def _train_recording(config_path, overrides, snapshot):
    """main_loop with the order of steps, save starts and publications recorded (rank 0 writes the
    folders), and the actor as it was when step 1's save started exported to `snapshot`."""
    from hybridrl.trainer import loop as trainer_loop
    from hybridrl.checkpoint.folders import CheckpointManager
    from hybridrl.config.io import load_config
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.loop import main_loop

    save = trainer_loop._save
    trainer_loop._save = lambda saver, trainer, loader, step: (
        trainer_loop._export_hf(trainer, snapshot) if step == 1 else None) or save(saver, trainer, loader, step)
    events = []
    prepare, publish, train_step = CheckpointManager.prepare, CheckpointManager.publish, PPOTrainer.train_step
    CheckpointManager.prepare = lambda self, step: events.append(("prepare", step, sorted(self.complete_steps()))) \
        or prepare(self, step)
    CheckpointManager.publish = lambda self, step, meta: events.append(("publish", step)) or publish(self, step, meta)
    PPOTrainer.train_step = lambda self, prompts, step, **kw: events.append(("step", step)) or train_step(
        self, prompts, step, **kw)
    main_loop(load_config(config_path, overrides))
    return events


def _to_hf(step_folder, out, tp, pp):
    from hybridrl.checkpoint.to_hf import checkpoint_to_hf

    checkpoint_to_hf(step_folder, out, tp, pp)


@pytest.mark.slow
def test_async_save_publishes_in_order_and_converts_to_hf(tmp_path):
    import subprocess
    import sys

    from hybridrl.checkpoint import CheckpointManager, read_meta
    from hybridrl.checkpoint.integrity import FILES, list_files, record
    from hybridrl.models.hf_checkpoint import SafetensorsReader
    from test_checkpoint_damage import flip_byte
    from test_trainer import ROOT

    export, snapshot = tmp_path / "export", tmp_path / "at_save_1"
    events = run_distributed(_train_recording, 2, TINY, _overrides(tmp_path, [
        f"{LAYOUT['tp']}=2", "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.async_save=true",
        "trainer.max_actor_ckpt_to_keep=3", f"trainer.export_hf_dir={export}"]), str(snapshot))[0]
    order = {e[:2]: i for i, e in enumerate(events)}
    for step in (1, 2, 3):
        assert ("publish", step) in order, events
        if step > 1:  # each save starts after the one before was published, and the loop ran on meanwhile
            assert step - 1 in next(e[2] for e in events if e[:2] == ("prepare", step)), events
            assert order[("publish", step - 1)] > order[("step", step)], events
    root = tmp_path / "ckpt"
    assert sorted(CheckpointManager(str(root), 3).complete_steps()) == [1, 2, 3]
    assert not [n for n in os.listdir(root) if n.endswith(".tmp")]
    # meta.json lists every file both ranks wrote, with its size and crc32, also when written in the background
    for step in (1, 2, 3):
        folder = str(root / f"global_step_{step}")
        files = read_meta(folder)[FILES]
        assert sorted(files) == list_files(folder, skip=("meta.json",)) and files == record(folder, files)
        assert {"actor/__1_0.distcp", "rng/rank_00001.pt"} <= set(files), sorted(files)
    # ckpt-to-hf: the last step at world size 1 through the script (= the final export), and step 1 at
    # TP 1 x PP 2 in two processes (= the actor when that save started, though training went on meanwhile)
    last, first = tmp_path / "hf_step3", tmp_path / "hf_step1"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert_checkpoint.py"), "ckpt-to-hf",
                           "--input", str(root / "global_step_3"), "--output", str(last)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run(proc.args[:-4] + ["--tp", "2"] + proc.args[-4:], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("error: --tp 2 x --pp 1 ") == 1, \
        proc.stderr[-3000:]
    run_distributed(_to_hf, 2, str(root / "global_step_1"), str(first), 1, 2)
    # a byte flipped in a copy of a shard rank 1 wrote at TP 2: ckpt-to-hf (at TP 1) ends in one line, exit 2
    damaged = tmp_path / "damaged" / "global_step_3"
    shutil.copytree(root / "global_step_3", damaged)
    flip_byte(damaged / "actor" / "__1_0.distcp", 100)
    proc = subprocess.run(proc.args[:3] + ["--input", str(damaged), "--output", str(tmp_path / "hf_damaged")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert f"--input {damaged} is damaged: actor/__1_0.distcp (model and optimizer shards) holds other bytes" \
        in errors[0], errors
    for folder, reference in ((last, export), (first, snapshot)):
        got, want = SafetensorsReader(str(folder)), SafetensorsReader(str(reference))
        assert sorted(got.names()) == sorted(want.names())
        for name in want.names():
            assert torch.equal(got.read(name), want.read(name)), (folder, name)
    final, early = SafetensorsReader(str(export)), SafetensorsReader(str(snapshot))
    assert any(not torch.equal(final.read(n), early.read(n)) for n in final.names())  # training moved on
