"""What an advantage estimator reads beyond the rewards, over the DP-global batch: the old policy's token statistics
(the optimal token baselines) and the reward function's components (GDPO), which the step keeps beside the batch's
rows as it scores them (`keep_reward_components`)."""
from __future__ import annotations

from typing import Dict

import torch

from hybridrl import algos
from hybridrl.trainer.step_batch import gather_dp

COMPONENT_PREFIX = "reward_component/"
"""Batch keys of the reward components GDPO reads, one [rows] tensor per algorithm.gdpo_reward_keys entry."""


class RewardComponentError(ValueError):
    """A GDPO reward key the reward function did not return as a number for every response."""


def keep_reward_components(batch: Dict[str, torch.Tensor], infos: dict, algorithm) -> None:
    """Under GDPO, each of algorithm.gdpo_reward_keys' per-response values (from the reward function's dict) as a
    [rows] tensor of the batch, so that DAPO's filtering, streamed chunks and the DP gather carry them with the rows."""
    if algorithm.adv_estimator != "gdpo":
        return
    for key in algorithm.gdpo_reward_keys:
        values = infos.get(key)
        if values is None or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise RewardComponentError(
                f"algorithm.gdpo_reward_keys names {key!r}, which the reward function did not return as a number for "
                f"every response (its dict keys: {sorted(infos) or 'none beside score'}); return it from "
                f"compute_score as a float, or name one of those keys")
        batch[COMPONENT_PREFIX + key] = torch.tensor(values, dtype=torch.float32, device=batch["responses"].device)


def estimator_inputs(algorithm, batch: Dict[str, torch.Tensor], groups) -> Dict[str, object]:
    """The DP-global inputs `algos.compute_advantages` takes beyond the rewards for algorithm.adv_estimator: old
    log-probs and sum pi^2 (and rollout IS weights, where the rollout correction made them) for the optimal token
    baselines; GDPO's reward components and their weights; nothing for the others."""
    name = algorithm.adv_estimator
    if name == "gdpo":
        return {"components": [gather_dp(batch[COMPONENT_PREFIX + k], groups) for k in algorithm.gdpo_reward_keys],
                "component_weights": algorithm.gdpo_reward_weights}
    if name not in algos.TOKEN_STAT_ESTIMATORS:
        return {}
    keys = ("old_log_probs", "sum_pi_squared", "rollout_is_weights")
    return {k: gather_dp(batch[k], groups) for k in keys if k in batch}
