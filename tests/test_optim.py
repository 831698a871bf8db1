"""The trainable roles' optimizers (workers/optim.py): megatron-core's on the CPU, and torch AdamW.

megatron's mixed-precision and distributed optimizers run on gloo (tests/megatron_roles.py). Checked: a
checkpoint written before the first update (and one after it) resumes into a fresh optimizer and continues
exactly; a NaN gradient stops the step as on the CPU path; norms and biases are not weight-decayed on either path.
"""
import types

import pytest
import torch

from dist_helper import run_distributed
from megatron_roles import backward, megatron_on_cpu, megatron_role


def _train(module, opt, seeds) -> list:
    out = []
    for seed in seeds:
        backward(module, opt, seed)
        with megatron_on_cpu():
            out.append(opt.step()[0])
    return out


def _resume_run(dtype: str, distributed: bool, folder: str):
    """Save before the first update and after it; each resumes into a fresh role and steps on exactly."""
    import torch.distributed as dist

    from hybridrl.checkpoint.sharded import load_role, save_role
    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(1, 1)
    results = {}
    for saved_after in (0, 1):
        path = f"{folder}/after_{saved_after}"
        module, opt = megatron_role(dtype, distributed)
        _train(module, opt, range(saved_after))
        worker = types.SimpleNamespace(engine=types.SimpleNamespace(module=module), optimizer=opt)
        if dist.get_rank() == 0:
            import os
            os.makedirs(path)
        dist.barrier()
        with megatron_on_cpu():
            save_role(worker, path, False)
        updated = _train(module, opt, [5, 6])
        fresh, fresh_opt = megatron_role(dtype, distributed)
        with megatron_on_cpu():
            load_role(types.SimpleNamespace(engine=types.SimpleNamespace(module=fresh), optimizer=fresh_opt),
                      path, "actor")
        resumed = _train(fresh, fresh_opt, [5, 6])
        same = all(torch.equal(a, b) for a, b in zip(module.parameters(), fresh.parameters()))
        results[saved_after] = (updated, resumed, same, fresh_opt.step_count)
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("dtype,distributed", [("bfloat16", True), ("bfloat16", False), ("float32", False)])
def test_megatron_optimizer_resumes_from_a_save_before_and_after_the_first_update(tmp_path, dtype, distributed):
    results = run_distributed(_resume_run, 2 if distributed else 1, dtype, distributed, str(tmp_path))
    for res in results:
        for saved_after, (updated, resumed, same, steps) in res.items():
            assert updated == resumed == [True, True], saved_after
            assert same, f"saved after {saved_after} updates: the resumed run's parameters differ"
            assert steps == saved_after + 2


def _nan_run(dtype: str, distributed: bool):
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.workers.update import finish_step

    init_model_parallel(1, 1)
    module, opt = megatron_role(dtype, distributed)
    backward(module, opt, 0)
    next(p for p in module.parameters() if p.dim() == 2).main_grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in module.parameters()]
    engine = types.SimpleNamespace(groups=types.SimpleNamespace(dp=1))
    with megatron_on_cpu():
        try:
            finish_step(engine, opt, [{"actor/pg_loss": 0.5, "finite": True}], "actor")
            error = None
        except FloatingPointError as err:
            error = str(err)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, module.parameters()))
    return error, unchanged, opt.step_count


@pytest.mark.distributed
@pytest.mark.parametrize("dtype,distributed", [("bfloat16", True), ("bfloat16", False), ("float32", False)])
def test_megatron_optimizer_stops_on_a_nan_gradient_like_the_cpu_path(dtype, distributed):
    error, unchanged, steps = run_distributed(_nan_run, 1, dtype, distributed)[0]
    assert error is not None and "actor gradient norm is not finite (nan)" in error
    assert unchanged and steps == 0


def _decay_expectation(named_before, named_after, lr_wd: float):
    """Zero gradients: Adam's update is 0, so only decoupled weight decay moves a parameter."""
    for name, before in named_before.items():
        after = named_after[name]
        if before.dim() == 1 or name.endswith(".bias"):
            torch.testing.assert_close(after, before, rtol=0, atol=0, msg=name)
        else:
            torch.testing.assert_close(after, before * (1 - lr_wd), msg=name)


def _megatron_decay_run(dtype: str, distributed: bool):
    from hybridrl.config import OptimConfig
    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(1, 1)
    module, opt = megatron_role(dtype, distributed, OptimConfig(lr=0.1, weight_decay=0.5))
    module.zero_grad_buffer()
    before = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    with megatron_on_cpu():
        updated = opt.step()[0]
    return updated, before, {n: p.detach().float().clone() for n, p in module.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("dtype,distributed", [("float32", False), ("float32", True)])
def test_megatron_optimizer_leaves_norms_and_biases_undecayed(dtype, distributed):
    updated, before, after = run_distributed(_megatron_decay_run, 1, dtype, distributed)[0]
    assert updated and any(n.endswith(".bias") for n in before) and any(v.dim() == 1 for v in before.values())
    _decay_expectation(before, after, 0.1 * 0.5)


def test_cpu_optimizer_leaves_norms_and_biases_undecayed():
    from hybridrl.config import OptimConfig
    from hybridrl.workers.optim import CpuOptimizer

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3, bias=False))
    groups = types.SimpleNamespace(tp_rank=0, pp=1, ep=1, mp_group=None)
    opt = CpuOptimizer(module, OptimConfig(lr=0.1, weight_decay=0.5, lr_warmup_steps=0), groups, 10)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    updated, norm, _ = opt.step()
    assert updated and norm == 0.0
    _decay_expectation(before, dict(module.named_parameters()), 0.1 * 0.5)
