"""fp16 training: megatron's loss scaler reaches the backward through `grad_scale_func` (as in
Megatron-LM's training loop), overflow steps are skipped rather than fatal, and the CPU optimizer,
which has no loss scaler, refuses fp16 with the fix.

megatron-core's fp16 optimizer only accepts CUDA parameters, so the wiring is checked with its fp32
optimizer (same `scale_loss` / `get_loss_scale` contract, the scale set by hand to 4): the gradient
the schedule produces must be 4 times the unscaled one.
"""
import pytest
import torch

from dist_helper import run_distributed


def _scaled_backward():
    from megatron.core.utils import get_model_config

    from hybridrl.config import Config, OptimConfig
    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.gpt import GPTSpec, build_gpt
    from hybridrl.parallel.cpu_compat import cuda_to_cpu
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.optim import MegatronOptimizer

    init_model_parallel(1, 1)
    spec = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64, vocab_size=100)
    module = wrap_trainable(build_gpt(spec, 1, 1, 0), Config())
    ids = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))

    def grads():
        module.zero_grad_buffer()
        pipeline_forward(module, [{"input_ids": ids}], lambda out, mb: (out.float().mean(), {}), forward_only=False)
        return torch.cat([p.main_grad.flatten().clone() for p in module.parameters()])

    plain = grads()
    with cuda_to_cpu():
        opt = MegatronOptimizer(module, OptimConfig(lr=1e-3), False, 10, torch.float32)
    wired = get_model_config(module).grad_scale_func == opt.optimizer.scale_loss
    # megatron's FP32Optimizer returns its constant scale `_scale` from get_loss_scale: check that on the really
    # constructed members before standing in for fp16's dynamic scaler, so a rename fails here
    holds_scale = all(m.get_loss_scale() is getattr(m, "_scale", None) for m in opt.optimizer.chained_optimizers)
    for inner in opt.optimizer.chained_optimizers:
        inner._scale = torch.tensor([4.0])
    return wired and holds_scale, plain, grads()


@pytest.mark.distributed
def test_the_optimizers_loss_scale_multiplies_the_backward():
    wired, plain, scaled = run_distributed(_scaled_backward, 1)[0]
    assert wired
    assert plain.abs().sum() > 0
    torch.testing.assert_close(scaled, 4.0 * plain, rtol=1e-5, atol=1e-7)


def test_fp16_without_cuda_is_refused_with_the_fix():
    from hybridrl.config import ConfigError, OptimConfig
    from hybridrl.workers.optim import build_optimizer

    with pytest.raises(ConfigError, match="bfloat16"):
        build_optimizer(torch.nn.Linear(2, 2), OptimConfig(), None, 10, dtype=torch.float16)


class _Skipping:
    """Stand-in for an optimizer whose step reports 'not updated' (the branch under test is ours)."""

    def __init__(self, skips_overflow_steps):
        self.skips_overflow_steps, self.loss_scale = skips_overflow_steps, 2.0 ** 15

    def step(self):
        return False, float("nan"), 1e-3

    def advance_schedule(self):
        pass

    def current_lr(self):
        return 1e-3


def test_an_overflow_step_is_skipped_only_under_loss_scaling():
    import types

    from hybridrl.workers.update import finish_step

    engine = types.SimpleNamespace(groups=types.SimpleNamespace(dp=1))
    stats = [{"actor/pg_loss": 0.5, "finite": True}]
    metrics = finish_step(engine, _Skipping(True), stats, "actor")
    assert metrics["actor/skipped_steps"] == 1.0 and metrics["actor/loss_scale"] == 2.0 ** 15
    assert "actor/grad_norm" not in metrics
    with pytest.raises(FloatingPointError, match="gradient norm is not finite"):
        finish_step(engine, _Skipping(False), stats, "actor")
