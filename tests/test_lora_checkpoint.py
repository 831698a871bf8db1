"""LoRA through the trainer: GRPO with the KL loss (the reference is the base, adapters off) for 4 steps in
one go and as 2 + 2 with a resume in between must log the same numbers bit for bit; the checkpoint holds the
adapters and their Adam states but not the base (named in meta.json); trainer.export_hf_dir and
convert_checkpoint.py ckpt-to-hf write the same merged model, and its adapter/ folder loads in peft onto the
base with the merged model's logits."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dist_helper import run_distributed
from test_trainer import ROOT, TINY, _overrides, _train, read_scalars

LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=[linear_qkv,o_proj,linear_fc1,down_proj]",
        "actor.optim.lr=1e-2", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "trainer.save_freq=2",
        "trainer.log_freq=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_runs")
    full = _overrides(tmp / "full", LORA + ["trainer.total_training_steps=4", f"trainer.export_hf_dir={tmp}/export"])
    run_distributed(_train, 1, TINY, full)
    # the second run resumes from a copy of the first one's step-2 checkpoint
    shutil.copytree(tmp / "full" / "ckpt", tmp / "part" / "ckpt", ignore=shutil.ignore_patterns("global_step_4"))
    (tmp / "part" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    run_distributed(_train, 1, TINY, _overrides(tmp / "part", LORA + ["trainer.total_training_steps=4"]))
    return tmp


def test_resume_is_bit_exact(runs):
    full, part = read_scalars(runs / "full"), read_scalars(runs / "part")
    assert set(part["actor/pg_loss"]) == {3, 4}  # the second run started at step 3
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "actor/entropy"):
        for step in (3, 4):
            assert full[key][step] == part[key][step], (key, step, full[key][step], part[key][step])
    assert full["actor/kl_loss"][4] > 0  # the policy left the base, measured against the base


def test_resume_with_other_lora_settings_is_refused(runs):
    other = [a.replace("actor.lora.rank=8", "actor.lora.rank=4") for a in LORA]
    with pytest.raises(AssertionError, match="was saved with actor LoRA .*'rank': 8.* but this run has .*'rank': 4"):
        run_distributed(_train, 1, TINY, _overrides(runs / "part", other + ["trainer.total_training_steps=6"]))


def test_checkpoint_holds_adapters_and_their_optimizer_state_not_the_base(runs):
    from megatron.core import dist_checkpointing

    step = runs / "full" / "ckpt" / "global_step_4"
    saved = dist_checkpointing.load_tensors_metadata(str(step / "actor"))
    weights = [k for k in saved if not k.startswith("optimizer.")]
    assert weights and all(".lora_adapters." in k for k in weights), weights[:5]
    assert len(weights) == 2 * 7  # A, B of 7 HF modules, each stacked over the 2 layers (megatron's layout)
    assert all(saved[k].global_shape[0] == 2 for k in weights)
    assert {f"optimizer.state.{m}.{k}" for m in ("exp_avg", "exp_avg_sq") for k in weights} <= set(saved)
    meta = json.loads((step / "meta.json").read_text())
    assert meta["lora"] == {"base": str(runs / "full" / "ckpt" / "init_hf"), "rank": 8, "alpha": 16.0,
                            "dropout": 0.0, "target_modules": ["linear_qkv", "o_proj", "linear_fc1", "down_proj"]}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_and_ckpt_to_hf_give_the_merged_model_and_a_peft_adapter(runs):
    import peft
    import transformers
    from safetensors.torch import load_file

    export, base = runs / "export", runs / "full" / "ckpt" / "init_hf"
    converted = runs / "converted"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert_checkpoint.py"), "ckpt-to-hf",
                           "--input", str(runs / "full" / "ckpt" / "global_step_4"), "--output", str(converted)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged, again = load_file(export / "model.safetensors"), load_file(converted / "model.safetensors")
    start = load_file(base / "model.safetensors")
    assert set(merged) == set(again) == set(start)
    assert all(torch.equal(merged[k], again[k]) for k in merged)
    moved = [k for k in merged if not torch.equal(merged[k], start[k])]
    assert moved and all(k.endswith("_proj.weight") for k in moved), moved  # only the adapted linears changed
    for folder in (export, converted):
        config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base) and config["r"] == 8
    adapter = load_file(export / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == load_file(converted / "adapter" / "adapter_model.safetensors").keys()
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _logits(transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32), ids)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    assert (_logits(base_model, ids) - want).abs().max() > 1e-3
    peft_model = peft.PeftModel.from_pretrained(base_model, str(export / "adapter")).eval()
    torch.testing.assert_close(_logits(peft_model, ids), want, atol=1e-5, rtol=0)
