"""Let megatron-core 0.16.1 run forward, backward and its pipeline schedules on CPU (gloo).

`apply()` installs narrow patches, each for one CUDA touch point seen in megatron-core, and does
nothing when CUDA is available. It must not change numerics: every patch only moves work that
megatron-core places on "cuda" onto the CPU.

Patches (verified against megatron-core 0.16.1, torch 2.13.0 CPU):
1. `torch.cuda.current_device()` (RoPE inv_freq, DDP buffers and ~170 other call sites) returns
   the CPU device instead of raising.
2. `transformer.utils.get_default_causal_mask` / `get_sliding_window_causal_mask` build their masks
   with a literal device="cuda"; rebuilt on CPU (also where `fused_softmax` imported them).
3. The CUDA RNG tracker (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker().fork()`) reads
   and writes CUDA generator state; routed to the CPU default generator, so a forked state still
   drives CPU random ops (dropout) and TP ranks keep distinct streams.
4. Explicit `device="cuda"` tensors in the pipeline schedules (`total_num_tokens`) and in DDP's
   buffers, plus `torch.cuda.synchronize()` after p2p ops: `cuda_to_cpu()`, a TorchFunctionMode that
   maps "cuda" devices to CPU, entered only around schedule calls and DDP construction (it costs
   ~25% of a tiny model's forward, so the rollout's plain forwards run without it), and a no-op
   synchronize.
`without_transformer_engine_gemm()` (MoE router without Transformer Engine) applies on CUDA too.
`standing_in_for_cuda(device)` makes another device take CUDA's place in 1 and 4 (the CPU otherwise):
tests/virtual_device.py uses it to emulate an accelerator whose tensors must never meet host tensors.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_STANDIN = [torch.device("cpu")]  # the device that takes CUDA's place


def cuda_standin() -> torch.device:
    return _STANDIN[0]


@contextlib.contextmanager
def standing_in_for_cuda(device):
    """Inside the block, `torch.cuda.current_device()` and explicit "cuda" devices mean `device`."""
    _STANDIN.insert(0, torch.device(device))
    try:
        yield
    finally:
        _STANDIN.pop(0)


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites an explicit CUDA device argument (keyword `device`, or a `.to("cuda")`) to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, standin = kwargs or {}, cuda_standin()
        if "device" in kwargs and (_is_cuda_device(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs = dict(kwargs, device=standin)
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], standin) + tuple(args[2:])
        if func is torch.Tensor.cuda:
            return args[0] if standin.type == "cpu" else args[0].to(standin)
        return func(*args, **kwargs)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


class _DropForkWarning(logging.Filter):
    # With the CUDA tracker aliased to the CPU generator, "CPU RNG state changed within GPU RNG
    # context" is the expected behaviour, not a bug.
    def filter(self, record):
        return "CPU RNG state changed" not in record.getMessage()


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())


def _patch_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    for module in (tutils, fused_softmax):
        module.get_default_causal_mask = _cpu_causal_mask
        module.get_sliding_window_causal_mask = _cpu_sliding_window_mask


def apply() -> bool:
    """Install the CPU patches once; returns True when they are active (no CUDA)."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = cuda_standin
    torch.cuda.synchronize = lambda device=None: None
    _patch_masks()
    _patch_rng()
    _APPLIED = True
    return True


def without_cuda_mode():
    """Inside a `cuda_to_cpu()` block: run a model forward without the per-op Python hook (the
    forward itself has no literal CUDA devices once the patches above are in; measured 0.78x the
    time of a hooked log-prob pass on the tiny demo)."""
    if torch.cuda.is_available() or cuda_standin().type != "cpu":  # an emulated device keeps its hooks
        return contextlib.nullcontext()
    return torch._C.DisableTorchFunction()


@contextlib.contextmanager
def cuda_to_cpu():
    """Map explicit "cuda" devices to CPU inside the block; a plain pass-through when CUDA exists."""
    if torch.cuda.is_available():
        yield
        return
    with CudaToCpuMode():
        yield


def without_transformer_engine_gemm() -> None:
    """megatron-core 0.16.1's MoE router reads `moe_utils.te_general_gemm`, a name bound only when
    Transformer Engine imports (NameError otherwise, CPU or GPU): bind it to None, the value that
    selects the plain torch matmul. Does nothing where TE bound it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
