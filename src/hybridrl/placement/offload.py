"""Move a megatron model's parameters, gradient buffers and optimizer states to host memory and back.

The storage behind each tensor is copied to host memory and then shrunk to zero bytes on its
device; `restore` regrows it in place and copies the bytes back. Tensors therefore keep their
identity: the views megatron's DDP keeps into its contiguous param/grad buffers, the optimizer's
references and tied weights all stay valid, and values come back bit-exactly. Storages shared by
several tensors are moved once. Gradients are not copied at all: every update zeroes them before
its first backward, so they are freed and come back zeroed (as megatron's own `offload_grad_buffers`
does). The host buffers of each part are kept from one offload to the next (pinned memory is slow to
allocate). On a CPU-only machine the same bookkeeping runs (host to host), which
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
    nbytes: int
    host: torch.Tensor | None  # uint8 copy of the whole storage; None when its values are not kept
    device: torch.device


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(hosts: list, i: int, nbytes: int, pin: bool) -> torch.Tensor:
    """hosts[i] when it has the size, else a new buffer put there."""
    if i < len(hosts) and hosts[i].numel() == nbytes:
        return hosts[i]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if i < len(hosts):
        hosts[i] = host
    else:
        hosts.append(host)
    return host


class TensorStash:
    """The storages of `tensors`, freed on their device until `restore()`.

    keep_values: their bytes wait in host memory (else they come back zeroed); `hosts`: host buffers
    to copy into, by position, reused where the size fits and filled in where not (a caller that
    stashes the same tensors again passes the same list)."""

    def __init__(self, tensors: Iterable[torch.Tensor], skip: set | None = None, keep_values: bool = True,
                 hosts: list | None = None):
        self.items: list[_Stashed] = []
        seen = skip if skip is not None else set()
        hosts = hosts if hosts is not None else []
        pin = torch.cuda.is_available()
        for t in tensors:
            storage = t.untyped_storage()
            if id(storage) in seen or storage.nbytes() == 0:
                continue
            seen.add(id(storage))
            host = _host_buffer(hosts, len(self.items), storage.nbytes(), pin) if keep_values else None
            if host is not None:
                host.copy_(_bytes_view(storage), non_blocking=pin)
            self.items.append(_Stashed(storage, storage.nbytes(), host, storage.device))
        if pin:
            torch.cuda.synchronize()  # the host copies must be complete before the memory is freed
        for item in self.items:
            item.storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def restore(self, values: bool = True) -> None:
        """Regrow every storage; with its bytes back, or zeroed when `values` is False (the caller is
        about to overwrite them all) or when they were not kept."""
        for item in self.items:
            item.storage.resize_(item.nbytes)
            if values and item.host is not None:
                _bytes_view(item.storage).copy_(item.host, non_blocking=item.device.type != "cpu")
            else:
                _bytes_view(item.storage).zero_()
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


def _optimizer_levels(optimizer) -> list:
    """Every object of an optimizer's wrapper chain: hybridrl's role optimizer -> megatron's
    (ChainedOptimizer -> its chained optimizers) -> the torch optimizer at the bottom."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:  # ChainedOptimizer.optimizer asserts a single member: never read it here
        return [optimizer] + [level for inner in chained for level in _optimizer_levels(inner)]
    return [optimizer] + _optimizer_levels(getattr(optimizer, "optimizer", None))


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Optimizer state tensors plus megatron's fp32 main copies of half-precision parameters, found
    at whatever level of the wrapper chain holds them (pass the role's optimizer as it is)."""
    out = []
    for level in _optimizer_levels(optimizer):
        if isinstance(level, torch.optim.Optimizer):
            for state in level.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            out += [t for group in getattr(level, attr, None) or [] for t in group]
    return out


PARTS = ("params", "grads", "optimizer")


class Offloader:
    """Offload / onload one role's model (chunks), grads and optimizer per an `OffloadConfig`.

    `place(on_device)` keeps the parts named there on the device and moves every other part its
    config offloads to host memory (grads are freed and come back zeroed). A storage reachable from
    two parts (fp32 parameters that an optimizer also lists) belongs to the first of params, grads,
    optimizer and moves with it.
    """

    def __init__(self, model, optimizer=None, config: OffloadConfig = OffloadConfig()):
        self.model, self.optimizer, self.config = model, optimizer, config
        self._stashes: dict[str, TensorStash] = {}
        self._hosts: dict[str, list] = {part: [] for part in PARTS}

    @property
    def offloaded(self) -> bool:
        return bool(self._stashes)

    def _tensors(self, part: str) -> list:
        if part == "optimizer":
            return optimizer_tensors(self.optimizer)
        return (param_tensors if part == "params" else grad_tensors)(self.model)

    def place(self, on_device=PARTS) -> dict:
        """Onload the parts in `on_device`, offload the other configured ones; {"offload/<part>_bytes": n}
        of the parts that moved out now."""
        moved = {}
        for part in PARTS:
            if part in on_device or not getattr(self.config, part):
                stash = self._stashes.pop(part, None)
                if stash is not None:
                    stash.restore()
        for i, part in enumerate(PARTS):
            if part in on_device or not getattr(self.config, part) or part in self._stashes:
                continue
            owned = {id(t.untyped_storage()) for p in PARTS[:i] for t in self._tensors(p)}
            self._stashes[part] = TensorStash(self._tensors(part), skip=owned, keep_values=part != "grads",
                                              hosts=self._hosts[part])
            moved[f"offload/{part}_bytes"] = self._stashes[part].nbytes
        return moved

    def device_bytes(self) -> dict:
        """{part: bytes of its storages on the device now} (offloaded storages hold none); a storage
        reachable from two parts counts for the first, as in `place`."""
        seen, out = set(), {}
        for part in PARTS:
            storages = {id(t.untyped_storage()): t.untyped_storage() for t in self._tensors(part)}
            out[part] = sum(st.nbytes() for key, st in storages.items() if key not in seen)
            seen |= storages.keys()
        return out

    def offload(self) -> dict:
        """Every configured part to host memory. Idempotent."""
        return self.place(())

    def onload(self) -> None:
        self.place(PARTS)


# ---- the hybrid-engine schedule ---------------------------------------------------------------------

HYBRID_PHASES = {
    "gen": {},
    "reward": {"reward_model": ("params",)},
    "old_log_prob": {"actor": ("params",)},
    "ref": {"ref": ("params",)},
    "values": {"critic": ("params",)},
    "update_critic": {"critic": PARTS},
    "update_actor": {"actor": PARTS},
    "update_weights": {"actor": ("params",)},
    "checkpoint": {"actor": PARTS, "critic": PARTS},
}
"""What each phase of a step (trainer timer names) needs on the device, per role. Everything else a
role's offload flags name stays in host memory: an idle role keeps only what its flags leave, so
the weight sync holds the actor's weights (not its grads and Adam states) beside the engine's.
`hybridrl.planner.plan` builds its per-phase memory estimate from the same table."""


class PhaseOffload:
    """Moves each role's state to where `HYBRID_PHASES` wants it as the trainer enters a phase.

    `engine_reads`: roles whose params the rollout engine reads as its own weights (shared, not
    copied): generation needs them on the device, so the "gen" phase keeps them there. Offload and
    onload keep each storage object (resized, not replaced), so the engine's aliases stay valid."""

    def __init__(self, offloaders: dict):
        self.offloaders = {role: o for role, o in offloaders.items() if o is not None}
        self.engine_reads: set = set()

    def needs(self, phase: str) -> dict:
        """{role: parts on the device} in `phase`."""
        needs = dict(HYBRID_PHASES[phase])
        if phase == "gen":
            needs.update({role: tuple(dict.fromkeys(needs.get(role, ()) + ("params",))) for role in self.engine_reads})
        return needs

    def enter(self, phase: str) -> None:
        needs = self.needs(phase)
        for role, offloader in self.offloaders.items():
            offloader.place(needs.get(role, ()))

    def device_bytes(self) -> dict:
        """{"<role>/<part>": bytes on the device now} over the roles."""
        return {f"{role}/{part}": n for role, o in self.offloaders.items() for part, n in o.device_bytes().items()}
