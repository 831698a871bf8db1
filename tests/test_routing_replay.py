"""Routing replay: a megatron MoE model told which experts to use computes what transformers computes when
its routers are forced to the same experts (scores of the model's own router, gathered at the given ids,
renormalised as the family does), at EP 1 and EP 2; replay is per model, and off by default."""
import os

import pytest
import torch

from dist_helper import run_distributed
from models_helper import mcore_logits, ragged_batch, reinit_parallel

L, E, K = 2, 4, 2


def _forced_routes(seed: int) -> torch.Tensor:
    """[B, S, L, K] distinct random experts per token and layer."""
    g = torch.Generator().manual_seed(seed)
    batch = ragged_batch(253)
    b, s = batch["input_ids"].shape
    return torch.rand(b, s, L, E, generator=g).argsort(-1)[..., :K]


def _hf_forced_logits(folder: str, routes: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    norm = model.config.norm_topk_prob if model.config.model_type == "qwen3_moe" else True

    def force(layer):
        def hook(gate, args, output):
            logits = output[0]
            idx = routes[:, :, layer].reshape(-1, K)  # HF flattens tokens batch-major
            probs = torch.softmax(logits.float(), -1).gather(1, idx)
            if norm:
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(logits.dtype), idx
        return hook

    gates = [m for n, m in model.named_modules() if n.endswith(("mlp.gate", "block_sparse_moe.gate"))]
    assert len(gates) == L
    for layer, gate in enumerate(gates):
        gate.register_forward_hook(force(layer))
    batch = ragged_batch(253)
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=pos).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    root = str(tmp_path_factory.mktemp("replay"))
    return {name: random_hf_model_folder(os.path.join(root, name), name.split("-")[0], seed=i, num_hidden_layers=L,
                                         vocab_size=253, **kw)
            for i, (name, kw) in enumerate({"qwen3_moe-raw": dict(norm_topk_prob=False), "mixtral": {}}.items())}


def _replayed(folders, ep, routes):
    from hybridrl.models.hf_checkpoint import model_from_hf

    groups = reinit_parallel(1, 1, ep)
    out = {}
    for name, folder in folders.items():
        model, spec = model_from_hf(folder, groups, moe_enable_routing_replay=True)
        plain, _ = model_from_hf(folder, groups)  # built without replay: routes passed to it change nothing
        batch = ragged_batch(spec.vocab_size)
        out[name] = {"replayed": mcore_logits(model, spec, groups, dict(batch, routed_experts=routes)),
                     "own": mcore_logits(model, spec, groups, batch),
                     "plain": mcore_logits(plain, spec, groups, dict(batch, routed_experts=routes))}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
def test_replayed_routes_match_transformers_forced_to_them(folders, ep):
    from models_helper import hf_logits

    routes = _forced_routes(ep)
    results = run_distributed(_replayed, ep, folders, ep, routes)
    valid = ragged_batch(253)["attention_mask"].bool()
    for name, folder in folders.items():
        forced, free = _hf_forced_logits(folder, routes), hf_logits(folder, ragged_batch(253))
        assert (forced[valid] - free[valid]).abs().max() > 1e-2, "the forced routes must change the model"
        for rank_out in results:
            got = rank_out[name]
            assert (got["replayed"][valid] - forced[valid]).abs().max() < 1e-4, name
            assert (got["own"][valid] - free[valid]).abs().max() < 1e-4, name
            assert (got["plain"][valid] - free[valid]).abs().max() < 1e-4, name
