"""MATH rule reward: the last \\boxed{...} of the response against the ground truth, 1.0 or 0.0.

Follows verl/utils/reward_score/math.py (Hendrycks' MATH normalisation): take the last
`\\boxed{...}` (balanced braces), `\\boxed x` or `\\fbox{...}`; normalise both sides (spaces,
\\left/\\right, \\!, dfrac/tfrac, degrees, dollars, percent, trailing "." and text units) and
compare the strings; when both sides parse as plain numbers or fractions (0.5, -3, 1/2,
\\frac{1}{2}) the values are compared exactly instead. Pure functions: no I/O, no state.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_TEXT = r"\\(?:text|textbf|textrm|mbox|mathrm)"
_UNITS = re.compile(_TEXT + r"\{\s*[a-zA-Z][a-zA-Z ]*\}(\^\{?\d\}?)?\s*$")
_UNWRAP = re.compile(_TEXT + r"\{([^{}]*)\}")
_NUMBER = re.compile(r"-?(\d+(\.\d*)?|\.\d+)")
_FRAC = re.compile(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")


def last_boxed_only_string(text: str) -> Optional[str]:
    """The last '\\boxed{...}' / '\\boxed x' / '\\fbox{...}' of text, braces balanced, or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):  # "\boxed 5$": the answer runs to "$" or end of line
        return "\\boxed " + re.split(r"[$\n]", text[start + len("\\boxed "):])[0].strip()
    open_at = text.find("{", start)
    if open_at < 0 or text[start:open_at] not in _BOX_COMMANDS:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    return None  # unbalanced: no answer


def remove_boxed(boxed: str) -> str:
    """'\\boxed{x}' -> 'x' (also '\\boxed x' and '\\fbox{x}')."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed "):]
    for cmd in _BOX_COMMANDS:
        if boxed.startswith(cmd + "{") and boxed.endswith("}"):
            return boxed[len(cmd) + 1:-1]
    raise ValueError(f"not a boxed answer: {boxed!r}")


def _fix_fracs(s: str) -> str:
    """'\\frac12' -> '\\frac{1}{2}', '\\frac1{2}' -> '\\frac{1}{2}'."""
    head, *parts = s.split("\\frac")
    out = head
    for p in parts:
        out += "\\frac"
        if p.startswith("{"):
            out += p
        elif len(p) < 2:
            return s
        elif p[1] == "{":
            out += "{" + p[0] + "}" + p[1:]
        else:
            out += "{" + p[0] + "}{" + p[1] + "}" + p[2:]
    return out


def normalize(answer: str) -> str:
    """Hendrycks-style canonical string of a MATH answer."""
    s = str(answer).strip().replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    without_units = _UNITS.sub("", s).strip()
    s = _UNWRAP.sub(r"\1", without_units or s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:  # "x = 5" -> "5"
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s.replace(" ", ""))
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000 -> 1000
        s = s.replace(",", "")
    s = s.rstrip(".")
    return "0" + s if s.startswith(".") else s


def to_number(s: str) -> Optional[Fraction]:
    """Exact value of a normalised plain number or fraction, None otherwise."""
    if _NUMBER.fullmatch(s) or re.fullmatch(r"-?\d+/\d+", s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = _FRAC.fullmatch(s)
    if m:
        try:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
        except (ValueError, ZeroDivisionError):
            return None
        return -value if m.group(1) else value
    return None


def is_equiv(a: str, b: str) -> bool:
    na, nb = normalize(a), normalize(b)
    if na == nb:
        return True
    va, vb = to_number(na), to_number(nb)
    return va is not None and vb is not None and va == vb


def compute_score(solution_str: str, ground_truth) -> float:
    """1.0 if the last boxed answer equals ground_truth (itself boxed or bare), else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    truth = str(ground_truth)
    truth_boxed = last_boxed_only_string(truth)
    if truth_boxed is not None:
        truth = remove_boxed(truth_boxed)
    return 1.0 if is_equiv(remove_boxed(boxed), truth) else 0.0
