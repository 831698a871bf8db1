"""GSM8k rule reward, with verl's semantics (verl/utils/reward_score/gsm8k.py).

Only the last 300 characters of the response are examined (as verl, to bound regex time).
strict: the last "#### <number>" is the answer; flexible: the last number anywhere in the tail.
Commas and "$" are stripped and the strings compared with the ground truth. Differences from
verl, both on purpose: a sentence-final "." is dropped ("#### 72." is 72), and in flexible mode
a match with no digit (a lone "," or ".") is skipped.
Pure functions: no I/O, no state.
"""
from __future__ import annotations

import re
from typing import Optional

SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\$?-?\$?[0-9.,]+)")
_NUMBER = re.compile(r"(-?\$?[0-9.,]+)")


def _clean(number: str) -> str:
    number = number.replace(",", "").replace("$", "")
    return number[:-1] if number.endswith(".") else number


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """The final answer in the tail of the response, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r} must be strict or flexible")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
        return _clean(matches[-1]) if matches else None
    for candidate in reversed(_NUMBER.findall(tail)):
        if any(c.isdigit() for c in candidate):
            return _clean(candidate)
    return None


def compute_score(solution_str: str, ground_truth, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """score if the answer equals ground_truth, format_score if one was found but is wrong, else 0."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth).strip() else float(format_score)
