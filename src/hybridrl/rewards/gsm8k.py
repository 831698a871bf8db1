"""GSM8k rule reward, exactly as verl 0.9.1 (verl/utils/reward_score/gsm8k.py) unless asked otherwise.

Only the last 300 characters of the response are examined (as verl, to bound regex time).
- strict (default): the last "#### " followed directly by a number ("-", digits, "." and ","); its
  commas are dropped. "#### $1,234" has no answer, "#### 72." answers "72.".
- flexible: the last number anywhere, as written (commas and a final period kept: "1,000" is not
  "1000", "72." is not "72"); a lone "." is skipped, a lone "," is not (both as verl).
- flexible_lenient (hybridrl's own, never the default): the last number that has a digit, with
  commas, "$" and a final period removed, so "The answer is $1,000." answers "1000".
The answer is compared as a string with the ground truth (a non-string ground truth as its str();
verl would score it 0). Pure functions: no I/O, no state.
"""
from __future__ import annotations

import re
from typing import Optional

SOLUTION_CLIP_CHARS = 300
METHODS = ("strict", "flexible", "flexible_lenient")
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_LENIENT_NUMBER = re.compile(r"(-?\$?[0-9.,]+)")


def _lenient(tail: str) -> Optional[str]:
    for candidate in reversed(_LENIENT_NUMBER.findall(tail)):
        if any(c.isdigit() for c in candidate):
            number = candidate.replace(",", "").replace("$", "")
            return number[:-1] if number.endswith(".") else number
    return None


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """The final answer in the tail of the response, or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {', '.join(METHODS)}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "flexible_lenient":
        return _lenient(tail)
    if method == "strict":
        matches = _STRICT.findall(tail)
        return matches[-1].replace(",", "") if matches else None
    matches = _NUMBER.findall(tail)
    if not matches:
        return None
    # verl's loop: the last match other than "." (when every match is ".", that "." itself)
    return next((m for m in reversed(matches) if m != "."), matches[0])


def compute_score(solution_str: str, ground_truth, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """score if the answer equals ground_truth, format_score if one was found but is wrong, else 0."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    truth = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    if method == "flexible_lenient":
        truth = truth.strip().replace(",", "")
    return float(score) if answer == truth else float(format_score)
