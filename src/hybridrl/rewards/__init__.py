"""Rule-based rewards: one pure scorer per task and the registry/manager that picks them.

Scorers take the decoded response text and the ground truth and return a float; they never
touch models, tokenizers or files (`registry.load_custom_reward` is the one loader of user code).

Rewards import only the config tree (for the reward section); they must not import models, data,
workers or the trainer.
"""
from hybridrl.rewards.registry import (BUILTIN_REWARDS, RewardError, RewardManager, combine_scores,
                                       get_reward_fn, load_custom_reward)

__all__ = ["BUILTIN_REWARDS", "RewardError", "RewardManager", "combine_scores", "get_reward_fn",
           "load_custom_reward"]
