"""Live-memory accounting on any device: the bytes of tensor storages a block allocated and still holds.

Used where no allocator statistics exist (CPU) or where they would count other work: the handoff's peak
(`reshard.update_engine_weights(measure_memory=True)`), the planner's checks against measured steps, the
memory benchmarks. It changes no result; every op pays a little bookkeeping while it is active.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorMeter(TorchDispatchMode):
    """Bytes of tensor storages allocated inside the `with` block and still alive; records the peak.

    Every aten op is seen; an output whose storage is not one of the op's inputs' storages is a new
    allocation (views and in-place ops share an input's storage and are not counted). A storage stops
    counting when it is freed (weakref), so the peak is what the block really held at once.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _track(self, t: torch.Tensor, input_storages: set) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live or key in input_storages or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out
