"""MoE weights on their way to the engines: vLLM's fused expert layout (read-back slices), and the trainer's
expert-parallel layout streamed into the native engine, verified."""
import os

import pytest
import torch

from dist_helper import run_distributed

from hybridrl.models.hf_config import spec_from_hf_config


class _FusedMoEParams:
    """vLLM's FusedMoE parameters of one layer on TP rank `rank`, filled as its weight loader does: expert e's
    gate (w1) into the first half of w13[e], up (w3) into the second, down (w2) into w2[e], each this rank's
    1/tp of the expert's intermediate size (written here from vLLM's FusedMoE, independently of hybridrl)."""

    def __init__(self, prefix, experts, hidden, inter, tp, rank):
        self.prefix, self.tp, self.rank, self.per = prefix, tp, rank, inter // tp
        self.params = {prefix + "w13_weight": torch.zeros(experts, 2 * self.per, hidden),
                       prefix + "w2_weight": torch.zeros(experts, hidden, self.per)}

    def load(self, e, kind, t):
        r, per = self.rank, self.per
        if kind in ("down_proj", "w2"):
            self.params[self.prefix + "w2_weight"][e] = t[:, r * per:(r + 1) * per]
        else:
            half = 1 if kind in ("up_proj", "w3") else 0
            self.params[self.prefix + "w13_weight"][e, half * per:(half + 1) * per] = t[r * per:(r + 1) * per]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_fused_expert_slices(tmp_path, family, tp):
    from safetensors.torch import load_file

    from hybridrl.models.hf_checkpoint import random_hf_model_folder
    from hybridrl.rollout.vllm_layout import stored_slice

    folder = random_hf_model_folder(str(tmp_path / family), family)
    spec, hf = spec_from_hf_config(folder), load_file(os.path.join(folder, "model.safetensors"))
    prefix = "block_sparse_moe.experts." if family == "mixtral" else "mlp.experts."
    for rank in range(tp):
        params = {}
        for layer in range(spec.num_layers):
            fused = _FusedMoEParams(f"model.layers.{layer}.{prefix}", spec.num_experts, spec.hidden_size,
                                    spec.moe_intermediate_size, tp, rank)
            for name, t in hf.items():
                if name.startswith(fused.prefix):
                    e, kind = name[len(fused.prefix):].split(".")[:2]
                    fused.load(int(e), kind, t)
            params.update(fused.params)
        experts = [n for n in hf if ".experts." in n]
        assert len(experts) == spec.num_layers * spec.num_experts * 3
        for name in experts:
            view, (dim, start, stop) = stored_slice(name, params, spec, tp, rank)
            assert torch.equal(view, hf[name].narrow(dim, start, stop - start)), (name, rank)


def _ep2_into_engine(folder):
    from hybridrl.models import hf_convert as hc
    from hybridrl.models.hf_checkpoint import SafetensorsReader, model_from_hf
    from hybridrl.placement import reshard
    from hybridrl.rollout.native import NativeEngine
    from models_helper import reinit_parallel

    groups = reinit_parallel(1, 1, 2)  # the trainer holds half of the experts on each rank
    model, spec = model_from_hf(folder, groups)
    out = {}
    for rollout_tp in (1, 2):
        engine = NativeEngine(spec, rollout_tp)
        report = reshard.update_engine_weights(engine, model, spec, groups, bucket_mb=0.05)
        reader, g = SafetensorsReader(folder), engine.groups
        expected = {name: hc.read_shard(name, reader, spec, g.tp, g.tp_rank) for _, name in hc.stage_names(spec, 1, 0)}
        out[rollout_tp] = (report.verified, report.direct, report.num_buckets,
                           all(torch.equal(engine.params[n], t) for n, t in expected.items()))
    return out


@pytest.mark.distributed
def test_ep2_trainer_streams_every_expert_into_the_engine(tmp_path):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path / "m"), "qwen3_moe", num_experts=4)
    for rank in run_distributed(_ep2_into_engine, 2, folder):
        for rollout_tp, (verified, direct, buckets, equal) in rank.items():
            assert verified and not direct and buckets > 1 and equal, (rollout_tp, verified, direct, buckets, equal)
