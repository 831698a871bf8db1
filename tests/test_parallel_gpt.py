"""megatron-core GPTModel on CPU under gloo: TP=2 and PP=2 equal TP=1/PP=1 for the same weights."""
import pytest
import torch

from dist_helper import run_distributed

from hybridrl.models.gpt import GPTSpec, build_gpt

SPEC = GPTSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, vocab_size=200, max_position_embeddings=64, rope_theta=10000.0,
               rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False)
B, S = 2, 12


def _inputs():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SPEC.vocab_size, (B, S), generator=g)
    grad_weights = torch.randn(B, S, SPEC.padded_vocab_size(1), generator=g)
    return tokens, grad_weights


def _randomize(model):
    # Deterministic random values for every tensor, biases and norms included.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            base = 1.0 if "layer_norm_weight" in name or "final_layernorm" in name else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}


def _split_dim(param):
    """Partition dim of a TP-sharded parameter, None when replicated."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _shard(name, full, tp, tp_rank, dim):
    if dim is None:
        return full
    if name.endswith("linear_fc1.weight"):  # [gate; up] is split per half, then re-fused
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank]


def _global_name(name, layer_offset):
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def _forward_backward(model, tokens, grad_weights, groups):
    """One microbatch through megatron-core's schedule; returns last-stage logits [B,S,V_local]."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        toks = next(data_iterator)
        pos = torch.arange(S).unsqueeze(0).expand(B, S)
        out = model(toks, pos, None)

        def loss_func(logits):
            v0 = groups.tp_rank * logits.shape[-1]
            w = grad_weights[..., v0:v0 + logits.shape[-1]]
            return (logits * w).sum(), {"logits": logits.detach()}
        return out, loss_func

    from hybridrl.parallel.cpu_compat import cuda_to_cpu

    with cuda_to_cpu():
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
            seq_length=S, micro_batch_size=B, forward_only=False)
    return losses[0]["logits"] if groups.is_last_stage else None


def _layout_run(tp, pp, full_state):
    from hybridrl.parallel.distributed import init_model_parallel

    groups = init_model_parallel(tp, pp)
    model = build_gpt(SPEC, tp, pp, groups.pp_rank)
    offset = groups.pp_rank * SPEC.num_layers // pp
    params = dict(model.named_parameters())
    state = {}
    for name, cur in model.state_dict().items():
        if "_extra_state" in name:
            continue
        full = full_state[_global_name(name, offset)]
        state[name] = _shard(name, full, tp, groups.tp_rank, _split_dim(params[name]) if name in params else None)
    model.load_state_dict(state, strict=False)
    tokens, grad_weights = _inputs()
    logits = _forward_backward(model, tokens, grad_weights, groups)
    grads = {_global_name(n, offset): p.grad.clone() for n, p in model.named_parameters()}
    dims = {_global_name(n, offset): _split_dim(p) for n, p in model.named_parameters()}
    return {"tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank, "logits": logits, "grads": grads, "dims": dims}


def _reference_run():
    from hybridrl.parallel.distributed import init_model_parallel

    groups = init_model_parallel(1, 1)
    model = build_gpt(SPEC, 1, 1, 0)
    full_state = _randomize(model)
    tokens, grad_weights = _inputs()
    logits = _forward_backward(model, tokens, grad_weights, groups)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return full_state, logits, grads


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference_run, 1)[0]


@pytest.mark.distributed
def test_tp2_equals_tp1(reference):
    full_state, ref_logits, ref_grads = reference
    outs = run_distributed(_layout_run, 2, 2, 1, full_state)
    logits = torch.cat([o["logits"] for o in sorted(outs, key=lambda o: o["tp_rank"])], dim=-1)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    for o in outs:
        for name, g in o["grads"].items():
            expect = _shard(name, ref_grads[name], 2, o["tp_rank"], o["dims"][name])
            torch.testing.assert_close(g, expect, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.distributed
def test_pp2_equals_pp1(reference):
    full_state, ref_logits, ref_grads = reference
    outs = run_distributed(_layout_run, 2, 1, 2, full_state)
    last = [o for o in outs if o["pp_rank"] == 1][0]
    torch.testing.assert_close(last["logits"], ref_logits, atol=1e-5, rtol=0)
    seen = set()
    for o in outs:
        for name, g in o["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
            seen.add(name)
    assert seen == set(ref_grads), "the two stages together must hold every parameter once"
