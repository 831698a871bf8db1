"""Reward of the synthetic addition task ("3+4=" -> "7"), shaped so a random policy can climb it.

The response arrives decoded, special tokens (eos) removed, so "stopped early" shows as "short".
With s = response.strip():
    +0.1  s starts with a digit
    +0.2  s is only a number, at most MAX_NUMBER_CHARS long ("short and numeric")
    +0.7  the leading number of s equals the ground truth, or else
    +0.3 * (1 - |error| / 10)  for a short number within NEAR_RANGE of an integer ground truth
So with ground truth 7: "7" scores 1.0, "7xyz" 0.8, "6" 0.57, "5" 0.54, "12" 0.45, "30" 0.3,
"5xyz" 0.1, "x7" 0.0. The near-miss credit gives a group of wrong answers a gradient towards the
right one: without it every wrong short number scores the same and GRPO's groups carry no signal
until a sample happens to be exactly right. A uniformly random policy over the
54-token builtin:tiny vocabulary scores about 0.03 (it starts with a digit 10/54 of the time and
rarely stops); a policy that has learned "one or two digits, then eos" scores >= 0.3 before it
learns any addition. `compute_exact_score` (the tool-calling task) gives 1 for exactly the right
number and 0 otherwise, so its mean is the share of correct answers. Pure functions: no I/O, no state.
"""
from __future__ import annotations

import re

STARTS_WITH_DIGIT = 0.1
SHORT_NUMBER = 0.2
CORRECT = 0.7
MAX_NUMBER_CHARS = 4
NEAR = 0.3
NEAR_RANGE = 10
_LEADING_NUMBER = re.compile(r"\d+")


def prediction(solution_str: str) -> str:
    """The leading number of the response ("" when it does not start with a digit)."""
    m = _LEADING_NUMBER.match(solution_str.strip())
    return m.group() if m else ""


def is_correct(solution_str: str, ground_truth) -> bool:
    """The leading number equals the ground truth (the task's accuracy, without partial credit)."""
    answer, truth = prediction(solution_str), str(ground_truth).strip()
    if not answer:
        return False
    try:
        return int(answer) == int(truth)
    except ValueError:  # a non-integer ground truth: compare as text
        return answer == truth


def _closeness(answer: str, ground_truth) -> float:
    """1 for an exact integer answer falling linearly to 0 at NEAR_RANGE away; 0 for a non-integer truth."""
    try:
        error = abs(int(answer) - int(str(ground_truth).strip()))
    except ValueError:
        return 0.0
    return max(0.0, 1.0 - error / NEAR_RANGE)


def compute_score(solution_str: str, ground_truth, near_miss: bool = True) -> float:
    """The score above; `near_miss=False` leaves out the near-miss credit (a wrong number then scores
    by its format only), as preference pairs are ranked."""
    s = solution_str.strip()
    answer = prediction(s)
    if not answer:
        return 0.0
    score = STARTS_WITH_DIGIT
    short = len(answer) == len(s) and len(s) <= MAX_NUMBER_CHARS
    if short:
        score += SHORT_NUMBER
    if is_correct(s, ground_truth):
        score += CORRECT
    elif short and near_miss:
        score += NEAR * _closeness(answer, ground_truth)
    return round(score, 6)  # 0.1 + 0.7 is 0.7999... in floats


def compute_exact_score(solution_str: str, ground_truth) -> float:
    """1.0 when the answer is exactly the ground-truth number (surrounding whitespace aside), else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
