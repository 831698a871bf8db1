"""A trainable role built with megatron-core's real optimizers on the CPU (no CUDA, no apex, no TE).

megatron's mixed-precision and distributed optimizers run here on gloo as they would on a GPU
without Transformer Engine or apex (torch's AdamW inside, megatron's local multi-tensor fallbacks):
`megatron_on_cpu()` maps their literal CUDA devices to the CPU and answers their type checks
(`param.type() == "torch.cuda.FloatTensor"`) with the CUDA names. Tests that read megatron's
optimizer attributes use these objects, so a megatron-core upgrade that renames one fails them.
"""
import contextlib
import dataclasses

import torch
from torch.overrides import TorchFunctionMode

SPEC = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=100, qkv_bias=True)


class _CudaTypeNames(TorchFunctionMode):
    """`tensor.type()` answers "torch.cuda.FloatTensor" for a CPU float tensor (megatron's type checks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and ".cuda." not in out:
            return out.replace("torch.", "torch.cuda.", 1)
        return out


@contextlib.contextmanager
def megatron_on_cpu():
    from hybridrl.parallel.cpu_compat import cuda_to_cpu

    with cuda_to_cpu(), _CudaTypeNames():
        yield


def megatron_role(dtype: str, distributed: bool, optim=None):
    """A tiny GPT in megatron DDP with megatron's optimizer: (module, workers.optim.MegatronOptimizer).
    Call inside a process with model parallelism initialised (dist_helper.run_distributed)."""
    from hybridrl.config import Config, OptimConfig
    from hybridrl.models.gpt import DTYPES, GPTSpec, build_gpt
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.optim import MegatronOptimizer

    cfg = Config()
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, use_distributed_optimizer=distributed))
    module = wrap_trainable(build_gpt(GPTSpec(**SPEC), 1, 1, 0, dtype), cfg)
    with megatron_on_cpu():
        opt = MegatronOptimizer(module, optim or OptimConfig(lr=1e-2, weight_decay=0.1), distributed, 10,
                                DTYPES[dtype])
    return module, opt


def backward(module, opt, seed: int) -> None:
    """Zeroed gradients, then one forward/backward of a squared-logit loss on random tokens."""
    from hybridrl.models.forward import pipeline_forward

    ids = torch.randint(0, SPEC["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    module.zero_grad_buffer()
    opt.zero_grad()
    pipeline_forward(module, [{"input_ids": ids}], lambda out, mb: (out.float().pow(2).mean(), {}), forward_only=False)
