"""Reference scores of verl 0.9.1's DAPO math scorer (`verl.utils.reward_score.math_dapo`, what verl's
`default_compute_score` uses for data_source "math", "math_dapo", "math_dapo_reasoning" and "aime*").

Run in the side venv that has verl (`make verl-reference`); it writes math_dapo_verl_0_9_1.json beside this
file, read by tests/test_verl_parity.py. The module is loaded from its file (it imports only `re`), so a
verl wheel unpacked on PYTHONPATH without verl's own dependencies serves too.
"""
import importlib.util
import itertools
import json
import os

PACKAGE = os.path.dirname(importlib.util.find_spec("verl").origin)  # found, not imported (verl imports ray)
with open(os.path.join(PACKAGE, "version", "version")) as _f:
    VERSION = _f.read().strip()
spec = importlib.util.spec_from_file_location(
    "math_dapo", os.path.join(PACKAGE, "utils", "reward_score", "math_dapo.py"))
math_dapo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(math_dapo)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_dapo_verl_0_9_1.json")

HAND = [
    ("so Answer: 5", "5"), ("ANSWER : 5\nthanks", "5"), ("Answer: 6", "5"), ("no answer here", "5"),
    ("Answer: 3\nlater Answer: 4", "4"), ("Answer: \\frac12", "\\frac{1}{2}"), ("Answer: $\\frac{1}{2}$", "0.5"),
    ("Answer: $1,000$", "1000"), ("Answer: 1,000", "1,000"), ("Answer: 5 cm", "5"), ("Answer: 12 degrees", "12^\\circ"),
    ("Answer: x = 3", "3"), ("Answer: \\text{(A)}", "(A)"), ("Answer: \\boxed{7}", "7"), ("Answer: an apple", "apple"),
    ("the result is \\boxed{6}", "5"), ("the result is \\boxed{5}", "5"), ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("so \\boxed{\\frac12}", "\\frac{1}{2}"), ("so \\boxed{ 5 }", "5"), ("so \\boxed{5", "5"),
    ("\\boxed{5}" + " filler" * 20, "5"), ("Answer: 5" + " x" * 200, "5"), ("x" * 400 + " Answer: 9", "9"),
    ("Answer: \\sqrt2", "\\sqrt{2}"), ("Answer: 50\\%", "50\\%"), ("Answer: \\$5", "5"), ("Answer: 3.0", "3"),
    ("Answer: -4", "-4"), ("answer:7", "7"), ("Answer:\n7", "7"), ("Answer: 2 \\text{ and } 3", "2,3"),
    ("Answer: \\overline{AB}", "AB"), ("Answer: 10 meters", "10"), ("Answer: [INVALID]", "[INVALID]"),
    ("both \\boxed{1} and \\boxed{2}", "2"),
]
PREFIXES = ["", "Let me think. ", "Step 1: add.\nStep 2: done.\n", "x" * 290]
ANSWERS = ["Answer: {a}", "answer: ${a}$", "The answer is \\boxed{{{a}}}", "Final Answer: \\boxed{{{a}}}",
           "{a}"]
VALUES = [("12", "12"), ("12", "13"), ("\\frac{3}{4}", "\\frac34"), ("2,500", "2500"), ("\\pi", "\\pi")]

if __name__ == "__main__":
    cases = [(s, g) for s, g in HAND]
    for prefix, form, (a, g) in itertools.product(PREFIXES, ANSWERS, VALUES):
        cases.append((prefix + form.format(a=a), g))
    out = [{"solution": s, "ground_truth": g, **math_dapo.compute_score(s, g)} for s, g in cases]
    with open(OUT, "w") as f:
        json.dump({"verl_version": VERSION, "cases": out}, f, indent=1)
    print(f"wrote {len(out)} cases to {OUT}")
