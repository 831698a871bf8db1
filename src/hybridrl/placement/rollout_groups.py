"""The rollout engine's process groups: TP groups of consecutive ranks, DP over them, and the prompt
pooling of one rollout-TP group (`join_requests`). Collective on the world; cached per process."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class RolloutGroups:
    """The rollout engine's layout: TP groups of consecutive ranks; DP over the groups."""
    tp: int
    tp_rank: int
    tp_group: object
    dp: int
    dp_rank: int
    solo_group: object
    """This rank alone (the engine's pipeline and context-parallel groups, both of size 1)."""


_GROUP_CACHE: dict[tuple, RolloutGroups] = {}


def new_rollout_groups(rollout_tp: int) -> RolloutGroups:
    """Collective on the world: rollout-TP groups [0..tp-1], [tp..2tp-1], ... (cached per process)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % rollout_tp:
        raise ValueError(f"rollout tensor_model_parallel_size={rollout_tp} does not divide the world "
                         f"size {world}; choose a divisor of {world}")
    key = (id(dist.group.WORLD), rollout_tp)  # a re-initialised world gets new groups
    if key not in _GROUP_CACHE:
        tp_group, _ = dist.new_subgroups(group_size=rollout_tp)
        solo_group, _ = dist.new_subgroups(group_size=1)
        _GROUP_CACHE[key] = RolloutGroups(rollout_tp, rank % rollout_tp, tp_group, world // rollout_tp,
                                          rank // rollout_tp, solo_group)
    return _GROUP_CACHE[key]


def join_requests(prompts: list, seeds: list, groups: RolloutGroups | None):
    """(all prompts, all seeds, (lo, hi)) of the rollout-TP group, which decodes as one batch.

    Ranks of one group may bring different prompts (their training-DP shards), the same ones
    (training TP/PP peers when rollout TP > training TP), or none (peers that receive the result
    by broadcast); each distinct contribution is generated once. [lo, hi) are this rank's prompts.
    """
    if groups is None or groups.tp == 1:
        return prompts, seeds, (0, len(prompts))
    gathered = [None] * groups.tp
    dist.all_gather_object(gathered, ([list(p) for p in prompts], list(seeds)), group=groups.tp_group)
    joint_prompts, joint_seeds, offsets = [], [], {}
    for rank_prompts, rank_seeds in gathered:
        key = (tuple(map(tuple, rank_prompts)), tuple(rank_seeds))
        if key not in offsets:
            offsets[key] = len(joint_prompts)
            joint_prompts += rank_prompts
            joint_seeds += rank_seeds
    mine = gathered[groups.tp_rank]
    lo = offsets[(tuple(map(tuple, mine[0])), tuple(mine[1]))]
    return joint_prompts, joint_seeds, (lo, lo + len(prompts))
