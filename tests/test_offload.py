"""Offload / onload bookkeeping: storages freed while offloaded, every tensor back bit-exactly in place
(gradients come back zeroed: never copied, since every update zeroes them first).

On CPU "host memory" is the same device, so the tests check what matters on a GPU too: the original
storages shrink to 0 bytes, the copies hold the values, and onload restores them in the same tensor
objects (views into megatron DDP's contiguous buffers stay views); the bytes copied and the host
buffers they go to are counted (`copy_spy.CopySpy`).
"""
import pytest
import torch

from copy_spy import CopySpy
from dist_helper import run_distributed

from hybridrl.config import OffloadConfig
from hybridrl.placement.offload import Offloader, TensorStash, grad_tensors, optimizer_tensors, param_tensors


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _snapshot(tensors):
    return [(t, t.detach().clone(), t.device, t.untyped_storage()) for t in tensors]


def _assert_restored(snapshot, zeroed=()):
    """Every tensor back in place with its values; those in `zeroed` (gradients) back as zeros."""
    zeroed = {id(t) for t in zeroed}
    for t, ref, device, storage in snapshot:
        assert t.device == device and t.untyped_storage() is storage
        assert t.dtype == ref.dtype and torch.equal(t, torch.zeros_like(ref) if id(t) in zeroed else ref)


def _tiny_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 11, bias=False))
    model[2].weight = model[0].weight  # tied weights: one storage, two names
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.arange(5)).sum().backward()
    opt.step()
    return model, opt


def test_offload_frees_and_onload_restores_plain_module():
    model, opt = _tiny_model_and_optimizer()
    params, grads, states = param_tensors(model), grad_tensors(model), optimizer_tensors(opt)
    assert len(states) == 3 * 3  # step, exp_avg, exp_avg_sq for the 3 distinct parameters
    snap = _snapshot(params + grads + states)
    expect = {"offload/params_bytes": _storage_bytes(params), "offload/grads_bytes": _storage_bytes(grads),
              "offload/optimizer_bytes": _storage_bytes(states)}
    off = Offloader(model, opt, OffloadConfig(params=True, grads=True, optimizer=True))
    assert off.offload() == expect
    assert off.offload() == {}  # idempotent
    assert all(t.untyped_storage().nbytes() == 0 for t in params + grads + states)
    off.onload()
    _assert_restored(snap, zeroed=grads)
    assert model[2].weight is model[0].weight
    # the optimizer keeps working on the restored state
    model(torch.arange(5)).sum().backward()
    opt.step()


def test_offload_copies_no_gradient_and_reuses_its_host_buffers():
    """Two offload cycles: the bytes copied out and back are the parameters' and the optimizer's only,
    into the same host buffers both times (the spy holds the first cycle's, so no address is reused)."""
    model, opt = _tiny_model_and_optimizer()
    params, grads, states = param_tensors(model), grad_tensors(model), optimizer_tensors(opt)
    kept = _storage_bytes(params) + _storage_bytes(states)
    off = Offloader(model, opt, OffloadConfig(params=True, grads=True, optimizer=True))
    hosts = []
    for _ in range(2):
        with CopySpy() as out:
            moved = off.offload()
        with CopySpy() as back:
            off.onload()
        assert out.nbytes == back.nbytes == kept
        assert moved["offload/grads_bytes"] == _storage_bytes(grads)  # freed on the device all the same
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        hosts.append(out.destinations())
    assert hosts[0] == hosts[1]


@pytest.mark.parametrize("role", ["params", "grads", "optimizer"])
def test_only_the_configured_role_moves(role):
    model, opt = _tiny_model_and_optimizer()
    groups = {"params": param_tensors(model), "grads": grad_tensors(model), "optimizer": optimizer_tensors(opt)}
    off = Offloader(model, opt, OffloadConfig(**{role: True}))
    off.offload()
    for name, tensors in groups.items():
        assert all((t.untyped_storage().nbytes() == 0) == (name == role) for t in tensors), name
    off.onload()


def test_stash_moves_a_shared_storage_once():
    base = torch.arange(10.0)
    views = [base[:4], base[4:], base]
    stash = TensorStash(views)
    assert stash.nbytes == 40 and base.untyped_storage().nbytes() == 0
    stash.restore()
    assert torch.equal(base, torch.arange(10.0)) and torch.equal(views[1], torch.arange(4.0, 10.0))


def _megatron_ddp_run():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from hybridrl.models.gpt import GPTSpec, build_gpt
    from hybridrl.parallel.cpu_compat import cuda_to_cpu
    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(1, 1)
    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=96, vocab_size=200, max_position_embeddings=32, qkv_bias=True)
    module = build_gpt(spec, 1, 1, 0)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    with cuda_to_cpu():
        model = DistributedDataParallel(module.config, ddp_config, module)
    tokens = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    model(tokens, pos, None).float().pow(2).mean().backward()
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = p.main_grad  # an alias, as workers.optim does for fp32 main grads
    opt = torch.optim.Adam(params, lr=1e-3)
    opt.step()
    with torch.no_grad():
        before = model(tokens, pos, None)
    buffers = [b.param_data for b in model.buffers] + [b.grad_data for b in model.buffers]
    tensors = param_tensors(model) + grad_tensors(model) + optimizer_tensors(opt)
    snap = _snapshot(tensors + buffers)
    off = Offloader(model, opt, OffloadConfig(params=True, grads=True, optimizer=True))
    moved = off.offload()
    freed = all(t.untyped_storage().nbytes() == 0 for t in tensors + buffers)
    off.onload()
    _assert_restored(snap, zeroed=grad_tensors(model) + [b.grad_data for b in model.buffers])
    views_intact = all(p.untyped_storage() is model.buffers[0].param_data.untyped_storage() and
                       p.main_grad.untyped_storage() is model.buffers[0].grad_data.untyped_storage() for p in params)
    with torch.no_grad():
        after = model(tokens, pos, None)
    return {"moved": moved, "freed": freed, "views_intact": views_intact, "same_forward": torch.equal(before, after),
            "buffer_bytes": sum(b.untyped_storage().nbytes() for b in buffers), "n_buffers": len(model.buffers)}


@pytest.mark.distributed
def test_megatron_ddp_buffers_offload_and_stay_views():
    res = run_distributed(_megatron_ddp_run, 1)[0]
    assert res["n_buffers"] == 1 and res["freed"] and res["views_intact"] and res["same_forward"]
    # params and grads live in DDP's two contiguous buffers; each is moved once, whole
    assert res["moved"]["offload/params_bytes"] + res["moved"]["offload/grads_bytes"] == res["buffer_bytes"]
    assert res["moved"]["offload/optimizer_bytes"] > 0


def test_place_keeps_a_phase_s_parts_and_offloads_the_idle_ones():
    """PhaseOffload's step: the parts a phase needs come back, the other configured ones leave."""
    model, opt = _tiny_model_and_optimizer()
    groups = {"params": param_tensors(model), "grads": grad_tensors(model), "optimizer": optimizer_tensors(opt)}
    snap = _snapshot([t for ts in groups.values() for t in ts])
    off = Offloader(model, opt, OffloadConfig(params=True, grads=True, optimizer=True))
    for on_device in [("params",), (), ("params", "grads", "optimizer"), ("params",)]:
        off.place(on_device)
        held = off.device_bytes()
        for part, tensors in groups.items():
            assert all((t.untyped_storage().nbytes() > 0) == (part in on_device) for t in tensors), (on_device, part)
            assert held[part] == (_storage_bytes(tensors) if part in on_device else 0)
    off.onload()
    _assert_restored(snap, zeroed=groups["grads"])


@pytest.mark.parametrize("mode", ["fingerprint", "exact"])
def test_a_verified_parameter_can_still_be_offloaded(mode):
    """The handoff digests the training parameters on both ends; on CPU a digest that pinned their
    storage (Tensor.numpy() marks it non-resizable) made the next offload fail."""
    from hybridrl.placement.fingerprint import weight_digest

    p = torch.nn.Parameter(torch.randn(16, 8))
    want = p.detach().clone()
    weight_digest(p, mode)
    weight_digest(p[3:], mode)
    stash = TensorStash([p])
    assert p.untyped_storage().nbytes() == 0
    stash.restore()
    assert torch.equal(p, want)


def _master_copies_run(distributed: bool):
    """A bf16 role with megatron's real mixed-precision optimizer (its distributed one when asked), one update
    made so Adam's moments exist; the role's own wrapper (workers.optim.MegatronOptimizer around megatron's
    ChainedOptimizer) is what the offload is handed."""
    from megatron_roles import backward, megatron_on_cpu, megatron_role

    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(1, 1)
    module, role = megatron_role("bfloat16", distributed)
    backward(module, role, 0)
    with megatron_on_cpu():
        role.step()
    members = role.optimizer.chained_optimizers
    attr = "shard_fp32_from_float16_groups" if distributed else "fp32_from_float16_groups"
    names = {"members": [type(m).__name__ for m in members],
             "has_masters": all(hasattr(m, attr) for m in members),
             "has_torch_optimizer": all(isinstance(getattr(m, "optimizer", None), torch.optim.Optimizer)
                                        for m in members)}
    masters = [t for m in members for group in getattr(m, attr, []) for t in group]
    moments = [v for m in members for st in m.optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1]
    found = {id(t.untyped_storage()) for t in optimizer_tensors(role)}
    snap = _snapshot(masters + moments)
    off = Offloader(module, role, OffloadConfig(optimizer=True))
    moved = off.offload()["offload/optimizer_bytes"]
    freed = all(t.untyped_storage().nbytes() == 0 for t in masters + moments)
    off.onload()
    _assert_restored(snap)
    return {**names, "n_masters": len(masters), "n_moments": len(moments), "freed": freed, "moved": moved,
            "all_found": {id(t.untyped_storage()) for t in masters + moments} <= found,
            "bytes": sum(t.numel() * t.element_size() for t in masters + moments)}


@pytest.mark.distributed
@pytest.mark.parametrize("distributed", [False, True])
def test_optimizer_offload_finds_fp32_master_copies_through_the_role_wrapper(distributed):
    """bf16 training keeps 4 of Adam's 12 B/param in megatron's fp32 master copies. The offload reads
    megatron's attribute names (chained_optimizers, optimizer, [shard_]fp32_from_float16_groups) from objects
    megatron-core really constructed, so an upgrade that renames one fails here."""
    res = run_distributed(_master_copies_run, 1, distributed)[0]
    assert res["members"] == ["DistributedOptimizer" if distributed else "Float16OptimizerWithFloat16Params"]
    assert res["has_masters"] and res["has_torch_optimizer"]
    assert res["n_masters"] > 0 and res["n_moments"] > 0 and res["all_found"]
    assert res["freed"] and res["moved"] >= res["bytes"]
