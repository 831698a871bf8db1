"""The step's rollout correction (algorithm.rollout_correction, verl 0.9.1's decoupled mode) and the check that
the engine's log-probs are of the distribution the trainer computes.

Decoupled mode, as verl's trainer: once the old log-probs are there and the token rewards made (KL in the
reward included), `algos.compute_rollout_correction_and_rejection_mask` runs on the DP-global batch (so batch
normalisation and the metrics are the whole batch's); the rejected response mask replaces batch["response_mask"]
(advantages, critic and actor losses all see it) and the IS weights go to the actor's loss as
batch["rollout_is_weights"]. Bypass mode corrects inside the actor's loss instead (workers/actor.py).

The log-probs: the engine reports log_softmax(logits / T) over the full vocabulary at the sampled token
(temperature applied; top-k / top-p only restrict which token is drawn, rollout/base.py), T = 1 for greedy,
which is what the actor computes (models/logprobs.py). vLLM reports that distribution only without top-k /
top-p (`logprobs_mode=processed_logprobs` is after them) and from 0.10.2 (raw log-probs before temperature
earlier), so where the loss uses the engine's log-probs such a setting is refused.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from hybridrl import algos
from hybridrl.config import Config, ConfigError, RolloutCorrectionConfig
from hybridrl.trainer.step_batch import gather_dp, local_slice


def correct_rollout(batch: Dict[str, torch.Tensor], mask: torch.Tensor, correction: RolloutCorrectionConfig,
                    groups) -> Tuple[torch.Tensor, Dict[str, float]]:
    """(the DP-global response mask after rejection, rollout_corr/ and training/rollout_probs_* metrics);
    `mask` is the DP-global mask, this rank's slices of the mask and the IS weights go into `batch`."""
    old, rollout = gather_dp(batch["old_log_probs"], groups), gather_dp(batch["rollout_log_probs"], groups)
    if not mask.any():
        return mask, {}
    weights, kept, metrics = algos.compute_rollout_correction_and_rejection_mask(old, rollout, mask,
                                                                                 **correction.kwargs())
    metrics.update(algos.rollout_probs_diff_metrics(old, rollout, mask))
    if correction.rollout_rs is not None:
        batch["response_mask"] = local_slice(kept, groups)
    if weights is not None:
        batch["rollout_is_weights"] = local_slice(weights, groups)
    return kept, metrics


def check_rollout_correction(cfg: Config, engine) -> None:
    """Refuse what the correction cannot do: bypass mode's reinforce loss with GSPO (it has no ratio), and an
    engine whose log-probs are of another distribution than the trainer's where the loss uses them (bypass
    mode, IS weights, rejection); `engine` None (split placement: native rollout ranks) has the trainer's."""
    c, r = cfg.algorithm.rollout_correction, cfg.rollout
    if c.bypass_mode and c.loss_type == "reinforce" and cfg.actor.policy_loss.loss_mode != "vanilla":
        raise ConfigError("algorithm.rollout_correction.loss_type=reinforce replaces the policy loss (no ratio), so "
                          f"actor.policy_loss.loss_mode={cfg.actor.policy_loss.loss_mode} would be ignored; set it to "
                          "vanilla, or loss_type=ppo_clip")
    if not (c.bypass_mode or c.corrects) or r.name != "vllm" or engine is None:
        return
    used = "algorithm.rollout_correction (bypass_mode, rollout_is or rollout_rs)"
    if r.top_p < 1 or r.top_k > 0:
        raise ConfigError(f"with rollout.top_p={r.top_p} / rollout.top_k={r.top_k} vLLM reports log-probs of the "
                          f"truncated distribution, the trainer of the full one, and {used} uses them; set "
                          "rollout.top_p=1 and rollout.top_k=-1, or rollout.name=native")
    mode = str(getattr(engine, "logprobs_mode", "processed_logprobs"))
    if not mode.endswith("processed_logprobs") and r.temperature not in (0, 1):
        raise ConfigError(f"this vLLM reports log-probs before temperature ({mode}) and {used} uses them at "
                          f"rollout.temperature={r.temperature}; upgrade vLLM to >= 0.10.2 or use temperature 1")
