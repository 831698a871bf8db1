"""DAPO's math scorer (verl 0.9.1's `math_dapo`, what verl routes data_source "math", "math_dapo",
"math_dapo_reasoning" and "aime*" to): +1 for a correct final answer, -1 otherwise (so a wrong answer is
pushed down, not merely not rewarded), with "acc" and "pred" beside the score.

Only the last 300 characters of a response are read. The answer is the text after the last
"Answer:" (any case) up to the line's end, normalised as Minerva's evaluation does (the last "=" side,
units and TeX decorations dropped, \\frac and \\sqrt shorthands braced, thousands commas of a plain
number removed) and compared with the equally normalised ground truth. A response without "Answer:"
falls back to its last \\boxed{...} within the final 100 characters, compared with the ground truth as
written (no normalisation): the way verl scores it.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional

READ_CHARS = 300
"""Characters read from the end of a response (the longest MATH-500 answer has 159)."""
BOX_CHARS = 100
"""Characters, from the end of what is read, searched for the \\boxed{} fallback."""
NO_ANSWER = "[INVALID]"

# normalisation tables of Minerva's answer check (as verl's math_dapo applies them, in this order)
_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots")
_UNWRAPPED = (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})", r"(\\overline\{)(.*?)(\})")
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(answer: str) -> str:
    """A final answer in the form Minerva's check compares."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACED:
        answer = answer.replace(old, new)
    for text in _DROPPED:
        answer = answer.replace(text, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)  # the first $...$ span, alone
    for pattern in _UNWRAPPED:
        answer = re.sub(pattern, "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)  # \frac12 -> \frac{1}{2}
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)  # \sqrt2 -> \sqrt{2}
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _boxed_content(text: str) -> Optional[str]:
    """What the last "\\boxed{" of text holds, braces balanced (only that spelling, as verl's fallback)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def judge(solution_str: str, ground_truth: Any) -> tuple[bool, str]:
    """(correct, the extracted prediction) of a response against its ground truth."""
    text, truth = solution_str[-READ_CHARS:], str(ground_truth)
    found = _ANSWER.findall(text)
    pred = normalize_final_answer(found[-1] if found else NO_ANSWER)
    if pred != NO_ANSWER:
        return pred == normalize_final_answer(truth), pred
    boxed = _boxed_content(text[-BOX_CHARS:])
    if boxed is not None:
        return boxed == truth, boxed
    return pred == normalize_final_answer(truth), pred


def compute_score(solution_str: str, ground_truth: Any) -> Dict[str, Any]:
    """{"score": +1.0 or -1.0, "acc": correct, "pred": the extracted answer}."""
    correct, pred = judge(solution_str, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
