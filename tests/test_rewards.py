"""Tests of hybridrl.rewards: gsm8k, math and arith scorers, the registry and RewardManager."""
import random

import pytest
import torch

from hybridrl.config import CustomRewardConfig, RewardConfig
from hybridrl.rewards import RewardError, RewardManager, get_reward_fn, load_custom_reward
from hybridrl.rewards import arith, gsm8k
from hybridrl.rewards import math as math_reward


# --- gsm8k -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, strict, flexible, lenient", [
    ("so she has 72 clips.\n#### 72", "72", "72", "72"),
    ("#### 5 first, then corrected\n#### 8", "8", "8", "8"),             # last one wins
    ("the loss is #### -3", "-3", "-3", "-3"),
    ("#### 2.5", "2.5", "2.5", "2.5"),
    ("#### 1,600", "1600", "1,600", "1600"),                           # strict drops commas, flexible not
    ("#### $18", None, "18", "18"),                                    # strict: a digit right after "#### "
    ("#### 72.", "72.", "72.", "72"),                                  # verl keeps the period
    ("she has 12 apples and 3 pears, so 15 in all.", None, "15", "15"),  # a lone "." is skipped
    ("no numbers here, sorry.", None, ",", None),                      # ... a lone "," is not (verl)
    ("####72", None, "72", "72"),                                      # strict needs the space
    ("The answer is $1,000.", None, "1,000.", "1000"),
])
def test_gsm8k_extraction(text, strict, flexible, lenient):
    assert gsm8k.extract_solution(text, "strict") == strict
    assert gsm8k.extract_solution(text, "flexible") == flexible
    assert gsm8k.extract_solution(text, "flexible_lenient") == lenient


def test_gsm8k_scores_and_format_score():
    assert gsm8k.compute_score("#### 72", "72") == 1.0
    assert gsm8k.compute_score("#### 72", " 72 ") == 0.0                 # compared as written, as verl
    assert gsm8k.compute_score("#### 72", " 72 ", method="flexible_lenient") == 1.0
    assert gsm8k.compute_score("#### 71", "72") == 0.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0
    assert gsm8k.compute_score("#### 72.0", "72") == 0.0                 # string comparison, as verl
    assert gsm8k.compute_score("it is 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 72", 72) == 1.0                     # a non-string truth as its str()
    assert gsm8k.compute_score("it is 1,000.", "1000", method="flexible") == 0.0
    assert gsm8k.compute_score("it is 1,000.", "1,000", method="flexible_lenient") == 1.0
    with pytest.raises(ValueError, match="flexible_lenient"):
        gsm8k.extract_solution("#### 1", "lenient")


def test_gsm8k_only_the_last_300_characters_count():
    assert gsm8k.compute_score("#### 72" + "x" * 300, "72") == 0.0
    assert gsm8k.compute_score("#### 72" + "x" * 293, "72") == 1.0      # exactly 300 characters
    assert gsm8k.extract_solution("1" + "y" * 400, "flexible") is None


# --- math --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, boxed", [
    ("so \\boxed{\\frac{1}{2}}.", "\\boxed{\\frac{1}{2}}"),
    ("first \\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b}}}", "\\boxed{\\sqrt{\\frac{a}{b}}}"),
    ("the answer is $\\boxed 5$.", "\\boxed 5"),
    ("\\fbox{x+1}", "\\fbox{x+1}"),
    ("unbalanced \\boxed{\\frac{1}{2}", None),
    ("no box at all: 7", None),
])
def test_last_boxed_only_string(text, boxed):
    assert math_reward.last_boxed_only_string(text) == boxed


@pytest.mark.parametrize("answer, truth", [
    ("\\frac{1}{2}", "\\frac12"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "0.5"),
    ("-\\frac{3}{4}", "-0.75"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("90^\\circ", "90"),
    ("\\$10", "10"),
    ("10\\%", "10"),
    ("5\\text{ cm}", "5"),
    ("\\text{(A)}", "(A)"),
    ("x = 3", "3"),
    ("1,\\!000", "1000"),
    ("2.", "2"),
    (".5", "0.5"),
    ("\\sqrt3", "\\sqrt{3}"),
])
def test_math_equivalent_answers(answer, truth):
    assert math_reward.compute_score(f"We get \\boxed{{{answer}}}.", truth) == 1.0


def test_math_wrong_or_missing_answers():
    assert math_reward.compute_score("\\boxed{\\frac{1}{3}}", "0.5") == 0.0
    assert math_reward.compute_score("\\boxed{x+1}", "x+2") == 0.0
    assert math_reward.compute_score("the answer is 0.5", "0.5") == 0.0      # not boxed
    assert math_reward.compute_score("\\boxed{1/0}", "1") == 0.0             # no crash


def test_math_nested_braces_and_boxed_ground_truth():
    text = "Thus \\boxed{\\frac{\\sqrt{2}}{2}} is the answer."
    assert math_reward.compute_score(text, "\\frac{\\sqrt{2}}{2}") == 1.0
    assert math_reward.compute_score(text, "so $\\boxed{\\frac{\\sqrt2}{2}}$") == 1.0


# --- arith -------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, score", [
    ("7", 1.0), (" 7 ", 1.0), ("7xyz", 0.8), ("7 and more", 0.8), ("6", 0.57), ("5", 0.54),
    ("12", 0.45), ("30", 0.3), ("5xyz", 0.1), ("77777", 0.1), ("x7", 0.0), ("", 0.0), ("-7", 0.0),
])
def test_arith_partial_credit(response, score):
    assert arith.compute_score(response, "7") == score


def test_arith_near_misses_rank_by_distance_below_the_exact_answer():
    scores = [arith.compute_score(str(guess), "9") for guess in (9, 8, 11, 6, 13, 0, 19, 40)]
    assert scores == sorted(scores, reverse=True) and len(set(scores[:-1])) == 7
    assert scores[0] == 1.0 and scores[1] < arith.STARTS_WITH_DIGIT + arith.SHORT_NUMBER + arith.NEAR + 1e-9
    assert scores[-2:] == [0.3, 0.3]                                   # 10 or more away: no near-miss credit
    assert arith.compute_score("8", "x") == 0.3                        # a non-integer truth: none either
    assert arith.compute_score("8 apples", "9") == 0.1                 # only short answers earn it
    unshaped = get_reward_fn("synthetic/arith", shaped=False)          # how preference pairs are ranked
    assert [unshaped(str(guess), "9") for guess in (9, 8, 40)] == [1.0, 0.3, 0.3]
    assert get_reward_fn("synthetic/arith")("8", "9") == scores[1]


def test_arith_random_policy_is_low_and_short_numbers_are_high():
    from hybridrl.tokenizer import load_tokenizer

    tok, rng = load_tokenizer("builtin:tiny"), random.Random(0)

    def random_response():  # uniform tokens until eos, at most 16
        ids = []
        for _ in range(16):
            ids.append(rng.randrange(tok.vocab_size))
            if ids[-1] == tok.eos_token_id:
                break
        return tok.decode(ids)

    rows = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(2000)]
    random_mean = sum(arith.compute_score(random_response(), str(a + b)) for a, b in rows) / 2000
    assert random_mean <= 0.05
    short = [str(rng.randrange(10 ** rng.randint(1, 2))) for _ in rows]
    short_mean = sum(arith.compute_score(s, str(a + b)) for s, (a, b) in zip(short, rows)) / 2000
    assert short_mean >= 0.3 and short_mean >= 2 * random_mean


# --- registry and manager ----------------------------------------------------------------------

def test_registry_maps_data_sources():
    assert get_reward_fn("openai/gsm8k")("#### 3", "3") == 1.0
    assert get_reward_fn("openai/gsm8k")("it is 3", "3") == 0.0
    assert get_reward_fn("openai/gsm8k", "flexible")("it is 3", "3") == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert get_reward_fn(source)("\\boxed{3}", "3") == 1.0
    # verl's routing: "math", DAPO's sources and aime* go to DAPO's scorer, +1 / -1 (tests/test_verl_parity.py)
    for source in ("math", "math_dapo", "math_dapo_reasoning", "aime2024", "aime_2025"):
        assert get_reward_fn(source)("Answer: 3", "3") == 1.0 and get_reward_fn(source)("Answer: 4", "3") == -1.0
    assert get_reward_fn("synthetic/arith")("3", "3") == 1.0


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(RewardError) as e:
        get_reward_fn("my/dataset")
    msg = str(e.value)
    assert "my/dataset" in msg and "openai/gsm8k" in msg and "synthetic/arith" in msg
    assert "reward.custom_function.path" in msg


def test_manager_builtin_batch():
    manager = RewardManager(RewardConfig(gsm8k_method="flexible"))
    scores, extra = manager.score_batch(["so 72", "\\boxed{0.5}", "7x", "8", "x"],
                                        ["openai/gsm8k", "lighteval/MATH", "synthetic/arith", "synthetic/arith",
                                         "openai/gsm8k"],
                                        ["72", "\\frac{1}{2}", "7", "9", "1"], [{}] * 5)
    assert scores.dtype == torch.float32
    assert torch.allclose(scores, torch.tensor([1.0, 1.0, 0.8, 0.57, 0.0]))
    # the extracted answer of every built-in (maj@N votes on it); "acc" as verl's reward managers give a rule
    # that returns a float (its score: gsm8k, math), the exact answer's where the score is shaped (arith)
    assert extra["pred"] == ["72", "0.5", "7", "8", ""]
    assert extra["acc"] == [1.0, 1.0, 1.0, 0.0, 0.0] and "score" not in extra
    with pytest.raises(RewardError, match="differ in length"):
        manager(["a"], ["math", "math"], ["1"])
    # DAPO's scorer returns a dict in verl, so its managers keep "score" beside "acc" and "pred"
    scores, extra = manager.score_batch(["Answer: 7", "\\boxed{8}"], ["math", "aime2024"], ["7", "9"])
    assert scores.tolist() == [1.0, -1.0]
    assert extra == {"score": [1.0, -1.0], "acc": [1.0, 0.0], "pred": ["7", "8"]}


CUSTOM = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth) + extra_info.get("bonus", 0.0)

def with_metrics(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "length": len(solution_str), "pred": solution_str}

def nan_for_b(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan") if solution_str == "b" else 1.0

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
'''


def _manager(path, name):
    return RewardManager(RewardConfig(custom_function=CustomRewardConfig(str(path), name)))


def test_custom_reward_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    scores, extra = _manager(path, "compute_score").score_batch(["a", "b"], ["x/y", "x/y"], ["a", "a"],
                                                                [{}, {"bonus": 0.25}])
    assert scores.tolist() == [1.0, 0.25] and extra == {"acc": [1.0, 0.25]}  # a float: "acc", as verl's managers
    scores, extra = _manager(path, "with_metrics").score_batch(["ab", "c"], ["s", "s"], ["", ""])
    # a dict: every key, "score" too (verl keeps it), and no "acc" of its own making
    assert scores.tolist() == [0.5, 0.5] and extra == {"score": [0.5, 0.5], "length": [2, 1], "pred": ["ab", "c"]}


def test_custom_reward_errors(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    with pytest.raises(RewardError, match=r"row 1 \(data_source='src/b'\)") as e:
        _manager(path, "nan_for_b")(["a", "b"], ["src/a", "src/b"], ["", ""])
    assert "nan" in str(e.value)
    with pytest.raises(RewardError, match="without 'score' for row 0"):
        _manager(path, "no_score")(["a"], ["s"], [""])
    with pytest.raises(RewardError, match="has no function 'missing'") as e:
        load_custom_reward(str(path), "missing")
    assert "compute_score" in str(e.value) and "reward.custom_function.name" in str(e.value)
    with pytest.raises(RewardError, match="does not exist") as e:
        load_custom_reward(str(tmp_path / "nope.py"))
    assert "nope.py" in str(e.value)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_xyz\n")
    with pytest.raises(RewardError, match="importing .*broken.py.* failed"):
        load_custom_reward(str(broken))


DATACLASS_REWARD = '''
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Verdict:
    answer: str
    bonus: float = 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(Verdict(solution_str).answer == ground_truth)
'''


def test_custom_reward_file_with_dataclasses_loads_and_pickles(tmp_path):
    import pickle
    import sys

    path = tmp_path / "dataclass_reward.py"
    path.write_text(DATACLASS_REWARD)
    fn = load_custom_reward(str(path))
    assert fn("s", "7", "7") == 1.0 and fn("s", "8", "7") == 0.0
    assert pickle.loads(pickle.dumps(fn)) is fn
    assert sys.modules[fn.__module__].__file__ == str(path)
    broken = tmp_path / "broken_reward.py"
    broken.write_text("raise RuntimeError('oops')\n")
    with pytest.raises(RewardError, match="RuntimeError: oops"):
        load_custom_reward(str(broken))
    assert not any(name.endswith("broken_reward") for name in sys.modules)  # a failed import leaves nothing


POPPING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = extra_info.pop("answer")  # a user's function that edits what it is given
    ground_truth.clear()
    return float(solution_str == answer)
'''


def test_reward_function_that_edits_its_inputs_leaves_the_prompts_intact(tmp_path):
    """Each prompt's extra_info is repeated once per response (rollout.n); the loader hands out the dataset's
    own dicts, so every call must get its own copy."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridrl.config import DataConfig
    from hybridrl.data.prompts import PromptDataset, PromptLoader
    from hybridrl.tokenizer import load_tokenizer

    rows = [{"data_source": "s", "prompt": f"{i}+1=", "reward_model": {"ground_truth": [str(i + 1)]},
             "extra_info": {"answer": str(i + 1), "index": i}} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "p.parquet"))
    loader = PromptLoader(PromptDataset([str(tmp_path / "p.parquet")], load_tokenizer("builtin:tiny"),
                                        DataConfig()), batch_size=4, shuffle=False)
    path = tmp_path / "popping.py"
    path.write_text(POPPING_REWARD)
    manager = _manager(path, "compute_score")
    n = 2
    rep = lambda xs: [x for x in xs for _ in range(n)]
    for _ in range(2):  # two epochs over the same rows
        prompts = next(iter(loader))
        responses = rep(["1", "2", "3", "4"])
        scores = manager(responses, rep(prompts.data_source), rep(prompts.ground_truth), rep(prompts.extra_info))
        assert scores.tolist() == [1.0] * 8
    assert [(r.extra_info, r.ground_truth) for r in loader.dataset.rows] == \
        [({"answer": str(i + 1), "index": i}, [str(i + 1)]) for i in range(4)]
