"""Sequence parallelism, context parallelism and packed sequences against the padded world-1 forward.

Per-token log-probs, entropy (actor) and values (critic), and every parameter's gradient (gathered to its
full HF tensor through the export stream), of Qwen3 dense and Qwen3-MoE at: packed; TP 2 with SP, padded
and packed; CP 2, packed and padded; TP 2 + SP + CP 2 (4 processes). The rows mix left-padded prompts and right-padded
responses of varied lengths, GQA (2 KV heads for 4 query heads) and one row shorter than 2·CP tokens.
A layout that silently fell back (no packing, no split) would still pass the value checks, so each run also
reports what it computed: the token count each rank's attention saw, which must be the packed or split one.
"""
import os

import pytest
import torch

from dist_helper import run_distributed

PROMPTS, RESPONSES, WIDTH = [3, 5, 1, 2, 4], [4, 2, 6, 0, 5], (6, 7)
"""Real prompt / response lengths per row (row 3 has 2 tokens: shorter than 2·CP = 4) and the padded widths."""


def _batch(vocab: int):
    from models_helper import padded_rl_rows

    g = torch.Generator().manual_seed(0)
    batch = padded_rl_rows(vocab, PROMPTS, RESPONSES, WIDTH, g)
    batch["attention_mask"] = batch["attention_mask"].long()
    weights = torch.randn(3, len(PROMPTS), WIDTH[1], generator=g)
    return batch, weights


def _finalized_grads(model, groups):
    """Full gradients as megatron's finalize + DDP would leave them: partial sums over CP (the schedule
    multiplied each loss by CP) and over TP (sequence-parallel and q/k-norm weights) are summed."""
    import torch.distributed as dist

    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if groups.cp > 1:
            dist.all_reduce(p.grad, group=groups.cp_group)
            p.grad /= groups.cp
        if groups.tp > 1 and (getattr(p, "sequence_parallel", False) and model.config.sequence_parallel
                              or "q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=groups.tp_group)
        p.data = p.grad


def _run_role(folder, groups, role, overrides):
    """(per-token results [B, R] masked, {hf name: full grad}, tokens each attention call saw)."""
    from hybridrl.models import sdpa_attention
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, model_from_hf
    from hybridrl.models.logprobs import vocab_parallel_token_stats
    from hybridrl.workers.moe_metrics import RouterStats, pass_sums

    if role == "critic":
        model, spec, _ = critic_from_hf(folder, groups, "float32", **overrides)
    else:
        model, spec = model_from_hf(folder, groups, "float32", **overrides)
    batch, weights = _batch(spec.vocab_size)
    mask = batch["response_mask"]
    R, S = mask.shape[1], batch["input_ids"].shape[1]

    def token_fn(output, labels):
        if role == "critic":
            return {"values": output.float()}
        lp, ent = vocab_parallel_token_stats(output, labels, groups.tp_group, spec.vocab_size, 0.7, True)
        return {"log_probs": lp, "entropy": ent}

    def loss_fn(tokens, mb):
        window = {k: v[:, S - R - 1:S - 1] * mask for k, v in tokens.items()}
        loss = sum((v * w).sum() for v, w in zip(window.values(), weights))
        return loss, {k: v.detach() for k, v in window.items()}

    seen = []
    original = sdpa_attention.SDPAttention.forward

    def counting(self, query, *args, **kwargs):
        seen.append(query.shape[0] * (query.shape[1] if query.dim() == 4 else 1))
        return original(self, query, *args, **kwargs)

    sdpa_attention.SDPAttention.forward = counting
    try:
        with RouterStats(model) as routing:
            out = pipeline_forward(model, [batch], loss_fn, forward_only=False, token_fn=token_fn)[0]
    finally:
        sdpa_attention.SDPAttention.forward = original
    _finalized_grads(model, groups)
    grads = dict(mcore_to_hf_stream(model, spec, groups, head="none" if role == "critic" else "lm"))
    routed = pass_sums(routing, groups)  # MoE: the tokens the metrics count, every rank's share added
    return out, grads, seen[0], None if routed is None else routed[:, -1].tolist()


def _layouts(folders, layouts):
    """Every (tp, cp, overrides) layout of this launch, on both models and both roles."""
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.distributed import init_model_parallel

    results = {}
    for name, (tp, cp, overrides) in layouts.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        groups = init_model_parallel(tp, 1, cp=cp)
        for model_name, folder in folders.items():
            for role in ("actor", "critic"):
                results[name, model_name, role] = _run_role(folder, groups, role,
                                                            dict(overrides, context_parallel_size=cp))
    return results


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    root = tmp_path_factory.mktemp("long")
    return {kind: random_hf_model_folder(os.path.join(root, kind), model_type=kind, seed=3)
            for kind in ("qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def world1(folders):
    aux = {"moe_aux_loss_coeff": 0.1}
    return run_distributed(_layouts, 1, folders, {"padded": (1, 1, {}), "packed": (1, 1, {"remove_padding": True}),
                                                  "padded_aux": (1, 1, aux),
                                                  "packed_aux": (1, 1, dict(aux, remove_padding=True))})[0]


REAL_TOKENS = sum(p + r for p, r in zip(PROMPTS, RESPONSES))


def _compare(result, reference):
    out, grads = result[:2]
    ref_out, ref_grads = reference[:2]
    for key in ref_out:
        torch.testing.assert_close(out[key], ref_out[key], atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())


@pytest.mark.distributed
def test_packed_world1_equals_padded(world1):
    for model in ("qwen3", "qwen3_moe"):
        for role in ("actor", "critic"):
            padded, packed = world1["padded", model, role], world1["packed", model, role]
            _compare(packed, padded)
            assert padded[2] == len(PROMPTS) * sum(WIDTH) and packed[2] == REAL_TOKENS  # no padding computed


@pytest.mark.distributed
def test_the_moe_load_balancing_loss_leaves_the_padding_out(world1):
    """With actor.moe_aux_loss_coeff > 0 the router's load-balancing loss is part of the gradient: padded and
    packed rows must give the same one (the padded layout's pad tokens counted in it: 1e-2 apart at 0.1)."""
    for role in ("actor", "critic"):
        _compare(world1["packed_aux", "qwen3_moe", role], world1["padded_aux", "qwen3_moe", role])
    plain, aux = world1["padded", "qwen3_moe", "actor"][1], world1["padded_aux", "qwen3_moe", "actor"][1]
    assert any(not torch.allclose(plain[n], aux[n]) for n in plain if ".gate." in n or "router" in n)


@pytest.mark.distributed
def test_sequence_and_context_parallel_on_two_ranks_equal_world1(world1, folders):
    layouts = {"sp": (2, 1, {"sequence_parallel": True}),
               "sp_packed": (2, 1, {"sequence_parallel": True, "remove_padding": True}),
               "cp": (1, 2, {"remove_padding": True}), "cp_padded": (1, 2, {})}
    ranks = run_distributed(_layouts, 2, folders, layouts)
    for (layout, model, role), result in ranks[0].items():
        _compare(result, world1["padded", model, role])
    for rank in ranks:  # what each rank's attention computed: SP gathers the sequence back for attention
        assert rank["sp", "qwen3", "actor"][2] == len(PROMPTS) * (sum(WIDTH) + 1)  # width 13 padded to 14
        assert rank["sp_packed", "qwen3", "actor"][2] == 36  # rows 7, 7, 7, 2, 9 padded to multiples of TP = 2
        assert rank["cp", "qwen3", "actor"][2] == 40 // 2  # to multiples of 2·CP = 4, half on each rank
        assert rank["cp_padded", "qwen3", "actor"][2] == len(PROMPTS) * 16 // 2  # rows of width 13 -> 16
        # the MoE metrics count every token the layout routed, not one rank's share (before: 35 and 20)
        assert set(rank["sp", "qwen3_moe", "actor"][3]) == {len(PROMPTS) * (sum(WIDTH) + 1)}
        assert set(rank["cp", "qwen3_moe", "actor"][3]) == {40}


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_sp_cp2_on_four_ranks_equals_world1(world1, folders):
    ranks = run_distributed(_layouts, 4, folders, {"tp_sp_cp": (2, 2, {"sequence_parallel": True,
                                                                        "remove_padding": True})})
    for rank in ranks:
        for (layout, model, role), result in rank.items():
            _compare(result, world1["padded", model, role])
        assert rank["tp_sp_cp", "qwen3", "actor"][2] == 48 // 2  # multiples of TP x 2·CP = 8, half per CP rank


def test_a_row_with_a_hole_is_refused_not_packed_over_its_neighbour():
    """Packing moves each row's tokens to [cu[row], cu[row] + count): a row with a hole in its mask would send
    two tokens to one place (row 0's last token under row 1's first)."""
    from hybridrl.models.packing import Pack

    good = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    assert Pack.of(good).dest.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="contiguous"):
        Pack.of(torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]]))
