"""The old policy's per-token statistics: what its pass puts into a step's batch (`estimator_inputs.py` hands an
estimator that reads them, `algos.TOKEN_STAT_ESTIMATORS`, their DP-global copies)."""
from __future__ import annotations

from typing import Dict

import torch

from hybridrl import algos


def old_policy_pass(actor, batch: Dict[str, torch.Tensor], batching, estimator: str) -> None:
    """batch["old_log_probs"] and ["old_entropy"] from the actor's forward (one pass over its logits); ["sum_pi_squared"]
    too where the estimator reads it (a second pass over the same logits, in the same forward)."""
    stats = actor.compute_token_stats(batch, batching, with_entropy=True,
                                      with_sum_pi_squared=estimator in algos.TOKEN_STAT_ESTIMATORS)
    batch["old_log_probs"], batch["old_entropy"] = stats.pop("log_probs"), stats.pop("entropy")
    batch.update(stats)
