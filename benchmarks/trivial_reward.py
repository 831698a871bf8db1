"""The trivial reward of bench_grpo_vs_trl.py, used by both hybridrl and TRL: the share of digits.

Cheap and pure, so the step time measures the RL machinery, not the scorer; it varies across the
samples of a group, so GRPO's advantages are not all zero.
"""


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def compute_score(data_source=None, solution_str: str = "", ground_truth=None, extra_info=None) -> float:
    """hybridrl's custom reward signature (reward.custom_function.path)."""
    return digit_share(solution_str)


def trl_reward(completions, **kwargs) -> list:
    """TRL's reward_funcs signature (plain-text completions)."""
    return [digit_share(c) for c in completions]
