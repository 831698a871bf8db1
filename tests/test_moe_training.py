"""MoE training at expert parallel 2 equals the single-process run: SFT losses and grad norms (the expert
gradients differ between EP ranks, so their norm is summed over EP), and the HF folder written from the
EP 2 layout loads in transformers with the same logits."""
import os

import pytest
import torch

from dist_helper import run_distributed

from hybridrl.data.tool_demos import write_demonstrations
from hybridrl.tokenizer import TINY_TOOLS_SPEC, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu_tools.yaml")
STEPS = 3
MOE = ["model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_topk=2", "model.moe_intermediate_size=32",
       "model.norm_topk_prob=false"]


def _sft_steps(root, ep, export):
    import torch.distributed as dist

    from hybridrl.config.io import load_config
    from hybridrl.sft.trainer import SFTTrainer, sft_loader
    from models_helper import mcore_logits, reinit_parallel

    cfg = load_config(CONFIG, MOE + [f"parallel.expert_model_parallel_size={ep}", f"sft.train_files=[{root}/d.parquet]",
                                     "sft.train_batch_size=8", "sft.micro_batch_size_per_gpu=4", "sft.max_length=96",
                                     f"trainer.default_local_dir={root}/init", "trainer.logger=[console]"])
    tok = load_tokenizer(TINY_TOOLS_SPEC)
    groups = reinit_parallel(1, 1, ep)
    torch.manual_seed(0)
    trainer = SFTTrainer(cfg, groups, tok, STEPS)
    loader = iter(sft_loader(cfg, tok, groups))
    out = {"steps": [(m["sft/loss"], m["sft/grad_norm"]) for m in (trainer.step(next(loader)) for _ in range(STEPS))]}
    if export:
        trainer.save(f"{root}/hf")
        batch = next(loader)
        out["batch"] = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].long()}
        out["logits"] = mcore_logits(trainer.engine.module, trainer.spec, groups, out["batch"])
    return out if dist.get_rank() == 0 else None


@pytest.mark.distributed
def test_sft_at_ep2_equals_ep1_and_exports(tmp_path):
    from models_helper import hf_logits

    write_demonstrations(str(tmp_path / "d.parquet"), n=32, seed=3)
    (ref,) = run_distributed(_sft_steps, 1, str(tmp_path), 1, False)
    ep2 = run_distributed(_sft_steps, 2, str(tmp_path), 2, True)[0]
    assert ref["steps"][-1][0] < ref["steps"][0][0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ep2["steps"], ref["steps"])):
        assert loss == pytest.approx(ref_loss, rel=1e-4), step
        assert norm == pytest.approx(ref_norm, rel=1e-4), step
    real = ep2["batch"]["attention_mask"].bool()
    expected = hf_logits(str(tmp_path / "hf"), ep2["batch"])
    assert torch.allclose(ep2["logits"][real], expected[real], atol=1e-4, rtol=1e-4)
