"""RMSNorm for the local layer spec that also runs under sequence parallelism.

megatron's `WrappedTorchNorm` (the local spec's norm without apex) refuses `sequence_parallel`. The
maths of a norm does not change under sequence parallelism (each TP rank normalises its own slice of
the sequence); what changes is that its weight sees only that slice, so its gradient is a partial sum.
Marking the weight `sequence_parallel` makes megatron's `finalize_model_grads` all-reduce it over TP,
as megatron does for its own fused norms. State-dict names are torch's (`weight`), as before.
"""
from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron's norm constructor (config, hidden_size, eps, ...)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"hybridrl's local norm is RMSNorm, the config asks for {config.normalization}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
