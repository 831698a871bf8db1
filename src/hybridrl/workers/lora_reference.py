"""The reference policy of a LoRA run: the actor's own model with its adapters disabled (no second copy)."""
from __future__ import annotations

from hybridrl.models.lora import adapters_disabled
from hybridrl.workers.actor import LogProbWorker


class BaseReference(LogProbWorker):
    """Log-probs of the frozen base: the actor's engine, every adapter switched off for the pass."""

    def compute_log_prob(self, batch, batching, with_entropy: bool = False):
        with adapters_disabled(self.engine.module):
            return super().compute_log_prob(batch, batching, with_entropy)
