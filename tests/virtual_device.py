"""An emulated accelerator for CPU tests: tensors that hold their values on the CPU but report the
device `VIRTUAL` ("meta"), and a check that fails whenever host tensors are mixed into their work.

Why not FakeTensorMode on "cuda" or the meta device itself: fake CUDA parameters abort the process
inside an nn.Module forward (a C++ device guard), and meta tensors carry no values, so sampling,
rewards and `.item()` could not run. Here every value is real and only the *placement* is emulated:

* `OnDevice` is a tensor subclass whose `.device` is VIRTUAL; C++ sees an ordinary CPU tensor.
  Device-ness belongs to the storage (a registry of device storages), so an alias that C++ hands
  back as a plain tensor (an autograd.Function returning its input) still counts as device memory.
* `DeviceCheck` (a TorchFunctionMode) sees every torch call made from Python. Explicit devices
  "meta"/"cuda" (and `torch.cuda.current_device()`, which means VIRTUAL here through
  `cpu_compat.standing_in_for_cuda`) create device results; `.cpu()` / `.to("cpu")` give host copies
  and `.to(device)` device copies, never aliases; anything computed from a device input is on the
  device. A call that mixes a device tensor with a host tensor of one or more dimensions raises
  `DeviceMixError`, as does an in-place op on a host tensor with device inputs (0-dim host tensors
  are scalars, which CUDA accepts too; `copy_` copies across devices and indexing takes host
  indices, as on CUDA). `.numpy()` of a device tensor raises, as it does for CUDA tensors.
* The tensor collectives of torch.distributed (all_reduce, all_gather, broadcast, p2p, ...) must get
  device tensors only: nccl refuses host tensors. They still run, on gloo.
* `on_device(module)` plays `module.cuda()`: its parameters and buffers become device tensors in
  place (identity, attributes and the optimizer's references are kept).

Not seen: ops that C++ runs internally, the backward pass (its gradients come from C++ kernels, so
it runs unchecked: `torch.autograd.backward` and `Tensor.backward` switch the check off), and code
inside `without_check()` (host code, which keeps its own megatron scratch buffers: `_host_scratch`).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

VIRTUAL = torch.device("meta")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "send", "recv",
               "_all_gather_base", "_reduce_scatter_base")


class DeviceMixError(RuntimeError):
    """A host tensor met device work (what would fail, or silently copy, on a real accelerator)."""


_DEVICE_STORAGES: "weakref.WeakSet" = weakref.WeakSet()  # storages that live on the emulated device


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


def is_on_device(t: torch.Tensor) -> bool:
    """OnDevice, or an alias of device storage that C++ returned as a plain tensor (a custom
    autograd.Function that returns its input, for one)."""
    return isinstance(t, OnDevice) or _storage(t) in _DEVICE_STORAGES


def label(t: torch.Tensor) -> torch.Tensor:
    """`t` as a device tensor (same storage)."""
    if type(t) is torch.Tensor:
        with torch._C.DisableTorchFunction():
            t = torch.Tensor.as_subclass(t, OnDevice)
    storage = _storage(t)
    if storage is not None:
        _DEVICE_STORAGES.add(storage)
    return t


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return torch.Tensor.as_subclass(torch.Tensor.clone(t), torch.Tensor)


def _rebuild(host):
    return label(host)


class OnDevice(torch.Tensor):
    """CPU storage, reported on VIRTUAL."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return VIRTUAL

    def __reduce_ex__(self, protocol):  # pickled (object collectives) as a host tensor, then re-labelled
        with torch._C.DisableTorchFunction():
            host = torch.Tensor.as_subclass(self, torch.Tensor)
        return _rebuild, (host,)


class OnDeviceParameter(OnDevice, torch.nn.Parameter):
    pass


def _is_virtual(device) -> bool:
    if isinstance(device, int):
        return True  # a CUDA ordinal
    if isinstance(device, str):
        device = torch.device(device)
    return isinstance(device, torch.device) and device.type in ("meta", "cuda")


def _target(func, args, kwargs):
    """("device" | "host" | None, args, kwargs with the virtual device replaced by the CPU)."""
    target = None
    if "device" in kwargs and kwargs["device"] is not None:
        target = "device" if _is_virtual(kwargs["device"]) else "host"
        kwargs = dict(kwargs, device="cpu")
    if func is torch.Tensor.to and len(args) > 1:
        spec = args[1]
        if isinstance(spec, torch.Tensor):
            target = "device" if isinstance(spec, OnDevice) else "host"
        elif isinstance(spec, (str, torch.device, int)) and not isinstance(spec, bool):
            target = "device" if _is_virtual(spec) else "host"
            args = (args[0], "cpu") + tuple(args[2:])
    if func in (torch.Tensor.cpu,):
        target = "host"
    if func is torch.Tensor.cuda:
        func, args, target = torch.Tensor.to, (args[0], "cpu"), "device"
    return func, target, args, kwargs


_CROSS_DEVICE = {torch.Tensor.copy_}
_BACKWARD = {torch.autograd.backward, torch.Tensor.backward, torch.autograd.grad}
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ior__", "__iand__"}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _check_mix(func, inputs, args) -> None:
    if func in _INDEXING:
        inputs = [t for t in tree_flatten((args[0],) + tuple(args[2:]))[0] if isinstance(t, torch.Tensor)]
    on_device = [is_on_device(t) for t in inputs]
    if not any(on_device) or func in _CROSS_DEVICE:
        return
    host = [tuple(t.shape) for t, d in zip(inputs, on_device) if not d and t.dim() > 0]
    name = getattr(func, "__name__", str(func))
    inplace = (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS
    if host or (inplace and not on_device[0]):
        raise DeviceMixError(f"{name}: device tensors mixed with host tensors of shapes {host or [()]}")


class DeviceCheck(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.enabled = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.enabled:
            return func(*args, **kwargs)
        if func in _BACKWARD:  # gradients come from C++ kernels, unlabelled: backward is not checked
            from hybridrl.parallel import cpu_compat

            self.enabled = False
            try:  # and runs as host code: a buffer megatron's backward makes on the current device is a host one
                with cpu_compat.standing_in_for_cuda("cpu"):
                    return func(*args, **kwargs)
            finally:
                self.enabled = True
        if func is torch.Tensor.numpy and args and is_on_device(args[0]):
            raise DeviceMixError("numpy() of a device tensor: copy it to the host first (.cpu())")
        func, target, args, kwargs = _target(func, args, kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if target is None:
            _check_mix(func, inputs, args)
        out = func(*args, **kwargs)
        tensors_in = {id(_storage(t)) for t in inputs}
        if target == "device":  # host -> device copies, as on a real device (never an alias of the host tensor)
            fresh = lambda t: t if is_on_device(t) or id(_storage(t)) not in tensors_in else torch.Tensor.clone(t)
            return tree_map(lambda t: label(fresh(t)) if isinstance(t, torch.Tensor) else t, out)
        if target == "host":
            return tree_map(lambda t: _host_copy(t) if isinstance(t, torch.Tensor) and is_on_device(t) else t, out)
        if any(is_on_device(t) for t in inputs):
            return tree_map(lambda t: label(t) if isinstance(t, torch.Tensor) else t, out)
        return out


def _checked_collective(name, real):
    def collective(*args, **kwargs):
        if not _MODE or not _MODE[-1].enabled:
            return real(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [tuple(t.shape) for t in tensors if not is_on_device(t)]
        if host:
            raise DeviceMixError(f"torch.distributed.{name} on host tensors of shapes {host}: nccl needs "
                                 "tensors on the run's device")
        return real(*args, **kwargs)
    return collective


def _checked_batch_p2p(real):
    def batch_isend_irecv(ops):
        if not _MODE or not _MODE[-1].enabled:
            return real(ops)
        host = [tuple(op.tensor.shape) for op in ops if not is_on_device(op.tensor)]
        if host:
            raise DeviceMixError(f"torch.distributed.batch_isend_irecv on host tensors of shapes {host}")
        return real(ops)
    return batch_isend_irecv


_MODE: list = []


@contextlib.contextmanager
def virtual_device():
    """The emulated accelerator: device creation, the mixing check and checked collectives."""
    from hybridrl.parallel import cpu_compat

    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    saved["batch_isend_irecv"] = dist.batch_isend_irecv
    for name, real in saved.items():
        setattr(dist, name, _checked_batch_p2p(real) if name == "batch_isend_irecv" else _checked_collective(name, real))
    mode = DeviceCheck()
    _MODE.append(mode)
    try:
        with cpu_compat.standing_in_for_cuda(VIRTUAL), mode:
            yield mode
    finally:
        _MODE.pop()
        for name, real in saved.items():
            setattr(dist, name, real)


_HOST_SCRATCH: list = []  # megatron's scratch-buffer pool of the host blocks (one per process)


@contextlib.contextmanager
def _host_scratch():
    """megatron-core keeps one process-wide pool of scratch buffers (`get_global_memory_buffer()`,
    attention's [b*np, sq, sk] baddbmm input for one), allocated on `torch.cuda.current_device()`
    and reused by any later call that fits. On a real accelerator host-run code allocates there on
    the device too; here it would leave host buffers in the pool for device work to pick up. So a
    host block gets a pool of its own."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    device_pool = parallel_state._GLOBAL_MEMORY_BUFFER
    if device_pool is None:  # megatron not initialised: nothing to keep apart
        yield
        return
    if not _HOST_SCRATCH:
        _HOST_SCRATCH.append(GlobalMemoryBuffer())
    parallel_state._GLOBAL_MEMORY_BUFFER = _HOST_SCRATCH[0]
    try:
        yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = device_pool


@contextlib.contextmanager
def without_check():
    """Run a block as host code: no check, no labels, host scratch buffers of its own (for
    components outside what a test covers)."""
    from hybridrl.parallel import cpu_compat

    mode = _MODE[-1]
    mode.enabled = False
    try:
        with cpu_compat.standing_in_for_cuda("cpu"), _host_scratch():
            yield
    finally:
        mode.enabled = True


def on_device(module: torch.nn.Module) -> torch.nn.Module:
    """`module.cuda()` for the emulated device: parameters and buffers re-labelled in place."""
    for p in module.parameters():
        if not isinstance(p, OnDevice):
            p.__class__ = OnDeviceParameter
        label(p)
    for b in torch.nn.Module.buffers(module):  # megatron DDP shadows .buffers
        if not isinstance(b, OnDevice):
            b.__class__ = OnDevice
        label(b)
    return module
