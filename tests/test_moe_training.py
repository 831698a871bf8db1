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


def _sft_trainer(root, ep, init, seed):
    """(trainer, groups, loader) of the MoE SFT run at EP `ep`, its random init (model seed from `seed`) in root/init."""
    from hybridrl.config.io import load_config
    from hybridrl.sft.trainer import SFTTrainer, sft_loader
    from models_helper import reinit_parallel

    cfg = load_config(CONFIG, MOE + [f"parallel.expert_model_parallel_size={ep}", f"sft.train_files=[{root}/d.parquet]",
                                     "sft.train_batch_size=8", "sft.micro_batch_size_per_gpu=4", "sft.max_length=96",
                                     f"trainer.default_local_dir={root}/{init}", "trainer.logger=[console]",
                                     f"model.seed={1000 + seed}"])
    tok = load_tokenizer(TINY_TOOLS_SPEC)
    groups = reinit_parallel(1, 1, ep)
    torch.manual_seed(seed)
    trainer = SFTTrainer(cfg, groups, tok, STEPS)
    return trainer, groups, iter(sft_loader(cfg, tok, groups))


def _loss_and_norm(metrics):
    return metrics["sft/loss"], metrics["sft/grad_norm"]


def _sft_steps(root, ep, export):
    import torch.distributed as dist

    from models_helper import mcore_logits

    trainer, groups, loader = _sft_trainer(root, ep, "init", 0)
    out = {"steps": [_loss_and_norm(trainer.step(next(loader))) for _ in range(STEPS)]}
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


def _save_then_step(root, ep, save_after):
    """STEPS steps at EP `ep`, the role saved after `save_after` of them; the metrics of every step."""
    import torch.distributed as dist

    from hybridrl.checkpoint.sharded import save_role

    trainer, _, loader = _sft_trainer(root, ep, "init", 0)
    steps = []
    for i in range(STEPS):
        if i == save_after:
            os.makedirs(f"{root}/ckpt", exist_ok=True)
            save_role(trainer, f"{root}/ckpt", async_save=False)
        steps.append(_loss_and_norm(trainer.step(next(loader))))
    return steps if dist.get_rank() == 0 else None


def _load_then_step(root, ep, skip):
    import torch.distributed as dist

    from hybridrl.checkpoint.sharded import load_role

    trainer, _, loader = _sft_trainer(root, ep, "init2", 1)  # another init: everything must come from the checkpoint
    load_role(trainer, f"{root}/ckpt", "actor")
    for _ in range(skip):
        next(loader)
    steps = [_loss_and_norm(trainer.step(next(loader))) for _ in range(STEPS - skip)]
    return steps if dist.get_rank() == 0 else None


@pytest.mark.distributed
@pytest.mark.parametrize("save_ep,load_ep", [(2, 1), (1, 2)])
def test_checkpoint_saved_at_one_ep_resumes_at_another(tmp_path, save_ep, load_ep):
    write_demonstrations(str(tmp_path / "d.parquet"), n=32, seed=3)
    steps = run_distributed(_save_then_step, save_ep, str(tmp_path), save_ep, 1)[0]
    resumed = run_distributed(_load_then_step, load_ep, str(tmp_path), load_ep, 1)[0]
    # the first step after the load shows the weights, the second the Adam moments and step count
    for (loss, norm), (ref_loss, ref_norm) in zip(resumed, steps[1:]):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
