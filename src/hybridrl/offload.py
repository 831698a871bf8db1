"""Move a megatron model's parameters, gradient buffers and optimizer states to host memory and back.

The storage behind each tensor is copied to host memory and then shrunk to zero bytes on its
device; `restore` regrows it in place and copies the bytes back. Tensors therefore keep their
identity: the views megatron's DDP keeps into its contiguous param/grad buffers, the optimizer's
references and tied weights all stay valid, and values come back bit-exactly. Storages shared by
several tensors are moved once. On a CPU-only machine the same bookkeeping runs (host to host), which
is what the tests exercise; it saves memory only when the originals live on an accelerator.
This module does not decide *when* to offload (the workers do) and never touches torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from hybridrl.config import OffloadConfig


@dataclass
class _Stashed:
    storage: torch.UntypedStorage
    host: torch.Tensor  # uint8 copy of the whole storage
    device: torch.device


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TensorStash:
    """The storages of `tensors`, moved to host memory and freed on their device until `restore()`."""

    def __init__(self, tensors: Iterable[torch.Tensor], skip: set | None = None):
        self.items: list[_Stashed] = []
        seen = skip if skip is not None else set()
        pin = torch.cuda.is_available()
        for t in tensors:
            storage = t.untyped_storage()
            if id(storage) in seen or storage.nbytes() == 0:
                continue
            seen.add(id(storage))
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_view(storage), non_blocking=pin)
            self.items.append(_Stashed(storage, host, storage.device))
        if pin:
            torch.cuda.synchronize()  # the host copies must be complete before the memory is freed
        for item in self.items:
            item.storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(item.host.numel() for item in self.items)

    def restore(self) -> None:
        for item in self.items:
            item.storage.resize_(item.host.numel())
            _bytes_view(item.storage).copy_(item.host, non_blocking=item.device.type != "cpu")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.items = []


# ---- what each role owns ----------------------------------------------------------------------------

def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _ddp_buffers(chunk) -> list:
    """megatron DDP's _ParamAndGradBuffer lists (on a plain nn.Module `buffers` is a method)."""
    found = []
    for attr in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, attr, None)
        found += list(value) if isinstance(value, (list, tuple)) else []
    return found


def param_tensors(model) -> list[torch.Tensor]:
    """Every parameter plus megatron DDP's contiguous param buffers (distributed optimizer)."""
    out = []
    for chunk in _chunks(model):
        out += [b.param_data for b in _ddp_buffers(chunk) if getattr(b, "param_data", None) is not None]
        out += [p.data for p in chunk.parameters()]
    return out


def grad_tensors(model) -> list[torch.Tensor]:
    """megatron DDP's contiguous grad buffers, `main_grad` views and plain `.grad` tensors."""
    out = []
    for chunk in _chunks(model):
        out += [b.grad_data for b in _ddp_buffers(chunk) if getattr(b, "grad_data", None) is not None]
        for p in chunk.parameters():
            out += [g for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    return out


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's wrappers (ChainedOptimizer -> MegatronOptimizer -> torch)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for inner in optimizer.chained_optimizers for o in _torch_optimizers(inner)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None and not isinstance(optimizer, torch.optim.Optimizer) else [optimizer]


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Optimizer state tensors plus megatron's fp32 main copies of half-precision parameters."""
    out = []
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    wrappers = [optimizer] + list(getattr(optimizer, "chained_optimizers", []) or [])
    for w in wrappers:
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            out += [t for group in getattr(w, attr, None) or [] for t in group]
    return out


class Offloader:
    """Offload / onload one role's model (chunks), grads and optimizer per an `OffloadConfig`."""

    def __init__(self, model, optimizer=None, config: OffloadConfig = OffloadConfig()):
        self.model, self.optimizer, self.config = model, optimizer, config
        self._stashes: dict[str, TensorStash] = {}

    @property
    def offloaded(self) -> bool:
        return bool(self._stashes)

    def offload(self) -> dict:
        """Move the configured parts to host memory; returns {"offload/<part>_bytes": n}. Idempotent."""
        if self.offloaded:
            return {}
        seen: set = set()  # a storage reachable from two roles (fp32 params in the optimizer) moves once
        parts = (("params", self.config.params, param_tensors, self.model),
                 ("grads", self.config.grads, grad_tensors, self.model),
                 ("optimizer", self.config.optimizer, optimizer_tensors, self.optimizer))
        for name, wanted, collect, owner in parts:
            if wanted and owner is not None:
                self._stashes[name] = TensorStash(collect(owner), skip=seen)
        return {f"offload/{name}_bytes": s.nbytes for name, s in self._stashes.items()}

    def onload(self) -> None:
        for stash in self._stashes.values():
            stash.restore()
        self._stashes = {}
