"""models/sdpa_attention: the local spec's core attention equals megatron's unfused DotProductAttention.

Each check builds one model, runs it, swaps every layer's core attention for megatron's own (no
weights move: core attention has none) and runs it again: logits at real tokens and every gradient
agree in fp32 at TP 1 and 2, with GQA, left- and right-padded rows, no mask (causal), and a KV-cache
decode step; fully masked (padding) rows stay finite.
"""
import pytest
import torch
import torch.nn.functional as F

from dist_helper import run_distributed
from models_helper import ragged_batch

from hybridrl.models.gpt import GPTSpec, build_gpt, transformer_layer_spec

SPEC = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
               vocab_size=211, max_position_embeddings=64, qkv_bias=True)
MOE = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=1, intermediate_size=64,
              vocab_size=101, qk_norm=True, num_experts=4, moe_topk=2, moe_intermediate_size=16)


def _unfused(model):
    """Every layer's core attention replaced by megatron's DotProductAttention (the same weights)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    for layer in model.decoder.layers:
        attn = layer.self_attention
        attn.core_attention = DotProductAttention(config=attn.config, layer_number=attn.layer_number,
                                                  attn_mask_type=AttnMaskType.causal, attention_type="self",
                                                  pg_collection=attn.pg_collection)
    return model


def _batch(vocab_size):
    """Left-padded prompts (models_helper.ragged_batch) with one row right-padded as well."""
    batch = ragged_batch(vocab_size)
    batch["attention_mask"][2, -2:] = 0
    return batch


def _run(model, ids, mask):
    """Logits and parameter gradients of a loss over the real tokens (pads carry no gradient)."""
    from hybridrl.models.forward import causal_padding_mask
    from hybridrl.parallel.cpu_compat import cuda_to_cpu, without_cuda_mode

    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    b, s = ids.shape
    ids, pos = ids.to(device), torch.arange(s, device=device).expand(b, s)
    mask = None if mask is None else mask.to(device)
    with cuda_to_cpu(), without_cuda_mode():
        logits = model(ids, pos, causal_padding_mask(mask, s)).float()
    real = torch.ones(b, s, device=device) if mask is None else mask.float()
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)).to(device)
    (logits * w * real[..., None]).sum().backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().cpu(), grads


def _compare(tp, spec, padded, dtype="float32", atol=1e-5):
    """Both attentions on one model: logits at real tokens and every gradient within atol (the CUDA
    test reuses this on the GPU's kernels)."""
    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(tp, 1)
    model = build_gpt(spec, tp, 1, 0, dtype)
    batch = _batch(spec.vocab_size)
    mask = batch["attention_mask"] if padded else None
    fused, fused_grads = _run(model, batch["input_ids"], mask)
    ref, ref_grads = _run(_unfused(model), batch["input_ids"], mask)
    real = torch.ones(fused.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused[real], ref[real], atol=atol, rtol=0)
    assert fused_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=atol, rtol=10 * atol, msg=name)
    return len(ref_grads)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_grads_equal_the_unfused_attention(tp):
    for padded in (True, False):
        assert all(run_distributed(_compare, tp, tp, SPEC, padded))


@pytest.mark.distributed
def test_moe_with_qk_norm_and_one_kv_head_equals_the_unfused_attention():
    assert run_distributed(_compare, 1, 1, MOE, True)[0]


def _decode_step():
    """One query per row against a cache of 7 keys (megatron's static inference: no mask type, sq 1)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hybridrl.models.gpt import transformer_config
    from hybridrl.models.sdpa_attention import SDPAttention
    from hybridrl.parallel.cpu_compat import cuda_to_cpu
    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(1, 1)
    config = transformer_config(SPEC, 1, 1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 4, 16, generator=g)
    k, v = torch.randn(2, 7, 3, 2, 16, generator=g)
    pads = torch.zeros(3, 1, 1, 7, dtype=torch.bool)
    pads[1, ..., :2] = True
    out = []
    for cls in (SDPAttention, DotProductAttention):
        attn = cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        with cuda_to_cpu():
            out.append([attn(q, k, v, m, attn_mask_type=AttnMaskType.no_mask) for m in (None, pads)])
    return out


@pytest.mark.distributed
def test_kv_cache_decode_step_equals_the_unfused_attention():
    fused, ref = run_distributed(_decode_step, 1)[0]
    for a, b in zip(fused, ref):
        assert a.shape == (1, 3, 64)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_local_spec_is_megatrons_with_sdpa_core_attention_for_dense_and_moe_layers():
    """megatron's local spec but for the core attention and the norms (models/norms.py: megatron's local norm
    refuses sequence parallelism)."""
    import dataclasses

    from megatron.core.models.gpt import gpt_layer_specs

    from hybridrl.models.norms import RMSNorm
    from hybridrl.models.sdpa_attention import SDPAttention

    for experts in (0, 4):
        for qk_norm in (False, True):
            ours = transformer_layer_spec("local", qk_norm, experts).submodules
            theirs = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts or None, qk_layernorm=qk_norm,
                                                              normalization="RMSNorm").submodules
            mine = ours.self_attention.submodules
            assert mine.core_attention is SDPAttention
            assert ours.input_layernorm is ours.pre_mlp_layernorm is RMSNorm
            assert not qk_norm or mine.q_layernorm is mine.k_layernorm is RMSNorm
            attention = theirs.self_attention.submodules
            unchanged = dataclasses.replace(mine, core_attention=attention.core_attention,
                                            q_layernorm=attention.q_layernorm, k_layernorm=attention.k_layernorm)
            assert unchanged == attention
            assert dataclasses.replace(ours, self_attention=theirs.self_attention, input_layernorm=theirs.input_layernorm,
                                       pre_mlp_layernorm=theirs.pre_mlp_layernorm) == theirs


def _state_names():
    from megatron.core.models.gpt import gpt_layer_specs

    from hybridrl.models import gpt
    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(1, 1)
    ours = build_gpt(MOE, 1, 1, 0).state_dict().keys()
    gpt.transformer_layer_spec = lambda kind, qk_norm, experts: gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=experts, qk_layernorm=qk_norm, normalization="RMSNorm")  # megatron's own (a spawned rank)
    return sorted(ours), sorted(build_gpt(MOE, 1, 1, 0).state_dict().keys())


@pytest.mark.distributed
def test_state_dict_names_are_megatrons():
    ours, megatron = run_distributed(_state_names, 1)[0]
    assert ours == megatron


def test_one_additive_mask_serves_every_layer_and_fully_masked_rows_see_themselves():
    from hybridrl.models.sdpa_attention import additive_mask

    mask = torch.tensor([[True, True, True], [True, False, True], [False, False, True]])[None, None]
    first = additive_mask(mask, torch.float32)
    assert additive_mask(mask, torch.float32) is first  # the next layer's call
    assert additive_mask(mask, torch.bfloat16) is not first
    expect = torch.tensor([[0, 1, 1], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)  # row 0 keeps its own key
    assert torch.equal(first[0, 0] == float("-inf"), expect)
    mask[0, 0, 2, 0] = True  # changed in place: converted again
    assert additive_mask(mask, torch.float32)[0, 0, 2, 0] == float("-inf")
    decode = additive_mask(torch.ones(1, 1, 1, 4, dtype=torch.bool), torch.float32)
    assert torch.equal(decode[0, 0, 0] == 0, torch.tensor([False, False, False, True]))


def _saved_per_layer(qk_norm):
    """Bytes autograd saves for one more layer (2 layers less 1) in an fp32 forward, and the planner's figure."""
    from hybridrl.parallel.cpu_compat import cuda_to_cpu
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.planner import memory as mem

    init_model_parallel(1, 1)
    s, b, saved = 128, 2, []
    for layers in (1, 2):
        spec = GPTSpec(num_layers=layers, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=256, vocab_size=101, max_position_embeddings=s, qkv_bias=True, qk_norm=qk_norm)
        model = build_gpt(spec, 1, 1, 0)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        mask = torch.triu(torch.ones(b, 1, s, s, dtype=torch.bool), 1)
        with cuda_to_cpu(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 101, (b, s)), torch.arange(s).expand(b, s), mask)
        saved.append(sum(storages.values()))
    arch = mem.Arch(2, spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.kv_channels,
                    spec.intermediate_size, spec.vocab_size, False, True, qk_norm)
    return saved[1] - saved[0], mem.layer_activation_bytes(arch, s, b, 1, "float32")


@pytest.mark.distributed
@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_layer_saves_what_the_planner_counts(qk_norm):
    """No s x s scores, K and V at their own heads, V copied out of the fused QKV output (else backward
    keeps all of it): the planner's layer within 2% (left out: RoPE's cos/sin, RMSNorm statistics)."""
    measured, planned = run_distributed(_saved_per_layer, 1, qk_norm)[0]
    assert planned == pytest.approx(measured, rel=0.02)


def test_packed_attention_keeps_memory_linear_in_the_sequence():
    """Each packed sequence runs the fused kernel: forward and backward of one 2048-token sequence never hold
    a [heads, L, L] score tensor (the math path, taken for 3-d inputs, holds 64 MiB of them here)."""
    from hybridrl.models.context_parallel import cp_attention
    from hybridrl.placement.reshard import LiveTensorMeter

    def packed_causal_attention(q, k, v, cu, scale):  # SDPAttention's packed path without context parallelism
        return cp_attention(q, k, v, cu, None, scale)

    L, heads, groups, d = 2048, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, heads, d, generator=g, requires_grad=True)
    k, v = (torch.randn(L, groups, d, generator=g, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 7, L], dtype=torch.int32)
    with LiveTensorMeter() as meter:
        packed_causal_attention(q, k, v, cu, d ** -0.5).sum().backward()
    assert meter.peak < heads * L * L * 4 / 8, meter.peak
    ref = torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1).repeat_interleave(2, 0),
                                                    v[a:b].transpose(0, 1).repeat_interleave(2, 0), is_causal=True,
                                                    scale=d ** -0.5).transpose(0, 1) for a, b in ((0, 7), (7, L))])
    torch.testing.assert_close(packed_causal_attention(q, k, v, cu, d ** -0.5), ref, atol=1e-5, rtol=1e-5)
