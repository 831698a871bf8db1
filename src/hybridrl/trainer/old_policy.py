"""The old policy's per-token statistics: what its pass puts into a step's batch, and what an advantage estimator
that reads them (`algos.TOKEN_STAT_ESTIMATORS`: the optimal token baseline) gets of them over the DP-global batch."""
from __future__ import annotations

from typing import Dict

import torch

from hybridrl import algos
from hybridrl.trainer.step_batch import gather_dp


def old_policy_pass(actor, batch: Dict[str, torch.Tensor], batching, estimator: str) -> None:
    """batch["old_log_probs"] and ["old_entropy"] from the actor's forward; ["sum_pi_squared"] too where the
    estimator reads it (one pass over the logits gives all three)."""
    stats = actor.compute_token_stats(batch, batching, with_entropy=True,
                                      with_sum_pi_squared=estimator in algos.TOKEN_STAT_ESTIMATORS)
    batch["old_log_probs"], batch["old_entropy"] = stats.pop("log_probs"), stats.pop("entropy")
    batch.update(stats)


def estimator_token_inputs(estimator: str, batch: Dict[str, torch.Tensor], groups) -> Dict[str, torch.Tensor]:
    """The DP-global old log-probs and sum pi^2 (and rollout IS weights, where the rollout correction made them)
    for an estimator that reads them; nothing for the others."""
    if estimator not in algos.TOKEN_STAT_ESTIMATORS:
        return {}
    keys = ("old_log_probs", "sum_pi_squared", "rollout_is_weights")
    return {k: gather_dp(batch[k], groups) for k in keys if k in batch}
