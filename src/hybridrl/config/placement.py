"""Sections placement and async_training: which ranks do what, and how far generation runs ahead.

verl's names where it has them: `placement.mode` is its `actor_rollout_ref.hybrid_engine` (colocated)
or not (split); `async_training.*` as in its one-step-off-policy and fully-async recipes.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.checks import check, one_of

PLACEMENT_MODES = ("colocated", "split")


@dataclass(frozen=True)
class PlacementConfig:
    mode: str = "colocated"
    """colocated: every rank trains and generates in turn (the hybrid engine); split: role-based groups."""
    rollout_world_size: int = 0
    """split: the last k ranks of the world only generate (a multiple of rollout TP; one engine per TP group)."""
    critic_world_size: int = 0
    """split: c ranks just before the rollout ranks train the critic; 0 keeps it on the actor's ranks."""

    def __post_init__(self):
        one_of("placement.mode", self.mode, PLACEMENT_MODES)
        check(self.rollout_world_size >= 0, "placement.rollout_world_size must be >= 0")
        check(self.critic_world_size >= 0, "placement.critic_world_size must be >= 0")
        split = self.mode == "split"
        check(split or (self.rollout_world_size == 0 and self.critic_world_size == 0),
              "placement.rollout_world_size / critic_world_size only apply with placement.mode=split; "
              "set placement.mode=split or drop them")
        check(not split or self.rollout_world_size > 0,
              "placement.mode=split needs placement.rollout_world_size=k > 0 (the last k ranks generate)")


@dataclass(frozen=True)
class AsyncTrainingConfig:
    staleness_threshold: int = 0
    """0: batch k+1 is generated after update k's weights arrive; 1: while the trainers update on batch k."""
    partial_rollout: bool = False
    """Pause in-flight generations when new weights arrive and continue them under the new version."""
    stream_prompts: int = 0
    """Hand finished prompt groups to the trainers in chunks of this many prompts; 0: the whole batch."""

    def __post_init__(self):
        check(self.staleness_threshold in (0, 1),
              f"async_training.staleness_threshold={self.staleness_threshold}: 0 (synchronous) and 1 (one-step "
              "off-policy) are supported")
        check(self.stream_prompts >= 0, "async_training.stream_prompts must be >= 0 (0: the whole batch)")
