"""MoE routing metrics by hand: the switch load-balancing loss and the load imbalance from a known routing."""
import pytest
import torch

from hybridrl.workers.moe_metrics import RouterStats


def test_aux_loss_and_imbalance_by_hand():
    # one layer, E = 4 experts, k = 2, T = 4 tokens; tokens per expert (3, 3, 1, 1), summed probabilities
    tokens = torch.tensor([3.0, 3.0, 1.0, 1.0])
    probs = torch.tensor([1.6, 1.2, 0.8, 0.4])
    sums = torch.cat([tokens, probs, torch.tensor([4.0])])[None]
    m = RouterStats.metrics(sums, topk=2)
    # E / (k T^2) * sum_e P_e f_e = 4 / (2 * 16) * (4.8 + 3.6 + 0.8 + 0.4) = 1.2
    assert m["actor/moe_aux_loss"] == pytest.approx(1.2)
    assert m["actor/moe_load_imbalance"] == pytest.approx(3 / 2)  # max 3 over mean 2
    balanced = torch.cat([torch.full((4,), 2.0), torch.full((4,), 1.0), torch.tensor([4.0])])[None]
    assert RouterStats.metrics(balanced, topk=2) == {"actor/moe_aux_loss": pytest.approx(1.0),
                                                     "actor/moe_load_imbalance": pytest.approx(1.0)}


def test_hooks_count_what_the_router_chose(tmp_path):
    from dist_helper import run_distributed

    assert run_distributed(_count, 1, str(tmp_path))[0]


def _count(root):
    from hybridrl.models.hf_checkpoint import model_from_hf, random_hf_model_folder
    from models_helper import ragged_batch, reinit_parallel
    from hybridrl.models.forward import pipeline_forward

    groups = reinit_parallel(1, 1)
    model, spec = model_from_hf(random_hf_model_folder(f"{root}/m", "qwen3_moe"), groups)
    batch = ragged_batch(spec.vocab_size)
    with RouterStats(model) as stats:
        pipeline_forward(model, [batch])
    sums = stats.sums()
    b, s = batch["input_ids"].shape
    assert sums.shape == (spec.num_layers, 2 * spec.num_experts + 1)
    assert torch.all(sums[:, :spec.num_experts].sum(1) == b * s * spec.moe_topk)  # every token sent k times
    assert torch.allclose(sums[:, spec.num_experts:-1].sum(1), torch.full((spec.num_layers,), float(b * s), dtype=sums.dtype))
    return True
