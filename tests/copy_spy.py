"""`with CopySpy() as spy:` records every `Tensor.copy_` made from Python inside the block, as
(destination, source), holding both (so no address is reused while the spy lives)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class CopySpy(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.copies.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))

    @property
    def nbytes(self) -> int:
        """Bytes written by the copies."""
        return sum(dst.numel() * dst.element_size() for dst, _ in self.copies)

    def destinations(self) -> list[int]:
        return [dst.data_ptr() for dst, _ in self.copies]
