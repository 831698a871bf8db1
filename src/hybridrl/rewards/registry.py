"""Which reward function scores which data_source, and the batch scorer the trainer calls.

`get_reward_fn(data_source)` maps known data sources to the rule scorers in this package;
`load_custom_reward(path, name)` loads a user's function from a .py file; `RewardManager(cfg)`
scores a batch of decoded responses into a FloatTensor [B]; `combine_scores` mixes those rule scores
with a reward model's (`reward_model.combine`). A user function is called verl-style,
fn(data_source=, solution_str=, ground_truth=, extra_info=), and may return a float or a dict
with "score" (its other keys come back as extra per-response values). Built-in scorers add "pred"
(the extracted answer, for maj@N) and, where the score has partial credit (the synthetic task),
"acc". Non-finite scores are errors.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import math as _math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hybridrl.config import RewardConfig
from hybridrl.rewards import arith, gsm8k, math, math_dapo

BUILTIN_REWARDS: Dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math_dapo",
    "math_dapo": "math_dapo",
    "math_dapo_reasoning": "math_dapo",
    "synthetic/arith": "arith",
    "synthetic/arith_tools": "arith_exact",
}


class RewardError(ValueError):
    """A reward that cannot be computed; the message names the row or file and the fix."""


def builtin_kind(data_source: str) -> Optional[str]:
    """Which built-in scorer a data_source gets: BUILTIN_REWARDS, and DAPO's math scorer for "aime*" (as verl)."""
    return "math_dapo" if data_source.startswith("aime") else BUILTIN_REWARDS.get(data_source)


def get_reward_fn(data_source: str, gsm8k_method: str = "strict", shaped: bool = True) -> Callable[[str, Any], float]:
    """The rule scorer fn(solution_str, ground_truth) -> float of a known data_source; `shaped=False`
    drops shaping that only guides a policy (the synthetic task's near-miss credit)."""
    kind = builtin_kind(data_source)
    if kind == "gsm8k":
        return functools.partial(gsm8k.compute_score, method=gsm8k_method)
    if kind == "math":
        return math.compute_score
    if kind == "math_dapo":
        return lambda solution, truth: math_dapo.compute_score(solution, truth)["score"]
    if kind == "arith":
        return arith.compute_score if shaped else functools.partial(arith.compute_score, near_miss=False)
    if kind == "arith_exact":
        return arith.compute_exact_score
    raise RewardError(f"no built-in reward for data_source={data_source!r}; known: "
                      f"{', '.join(BUILTIN_REWARDS)}, aime*. For other data, write a function "
                      "fn(data_source, solution_str, ground_truth, extra_info) in a .py file and "
                      "set reward.custom_function.path (and reward.custom_function.name)")


def builtin_extras(data_source: str, response: str, ground_truth: Any,
                   gsm8k_method: str = "strict") -> Dict[str, Any]:
    """Per-response values beside the built-in score: "pred" ("" when no answer), "acc" for arith (DAPO math returns
    its own dict, `RewardManager._raw_score`)."""
    kind = builtin_kind(data_source)
    if kind == "gsm8k":
        return {"pred": gsm8k.extract_solution(response, gsm8k_method) or ""}
    if kind == "math":
        boxed = math.last_boxed_only_string(response)
        return {"pred": math.normalize(math.remove_boxed(boxed)) if boxed else ""}
    if kind == "arith":
        return {"pred": arith.prediction(response), "acc": float(arith.is_correct(response, ground_truth))}
    return {}


def load_custom_reward(path: str, name: str = "compute_score") -> Callable:
    """The function `name` from the python file at `path` (imported by file path, and registered in sys.modules
    as importlib's recipe does, so dataclasses and pickle find the module)."""
    if not os.path.isfile(path):
        raise RewardError(f"reward.custom_function.path='{path}' does not exist; point it at a .py "
                          "file defining the reward function")
    module_name = "hybridrl_custom_reward_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"reward.custom_function.path='{path}' cannot be imported; use a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardError(f"importing reward.custom_function.path='{path}' failed: "
                          f"{type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"'{path}' has no function '{name}' (it defines {found}); set "
                          "reward.custom_function.name to one of them")
    return fn


@dataclass(frozen=True)
class _Builtin:
    """A built-in rule's score and its extras ("pred", arith's "acc"): a float to verl's managers, not a dict."""
    score: float
    extras: Dict[str, Any]


class RewardManager:
    """Scores decoded responses with the custom function when configured, else by data_source."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        custom = cfg.custom_function
        self.custom_fn = load_custom_reward(custom.path, custom.name) if custom.path else None
        self.fn_name = f"{custom.path}:{custom.name}" if custom.path else "built-in reward"

    def _raw_score(self, response: str, data_source: str, ground_truth: Any, extra_info) -> Any:
        if self.custom_fn is not None:  # copies: a function that edits them must not edit the dataset's rows
            return self.custom_fn(data_source=data_source, solution_str=response,
                                  ground_truth=copy.deepcopy(ground_truth), extra_info=copy.deepcopy(extra_info))
        if builtin_kind(data_source) == "math_dapo":  # verl's scorer returns its dict: kept whole, scored once
            return math_dapo.compute_score(response, ground_truth)
        score = get_reward_fn(data_source, self.cfg.gsm8k_method)(response, ground_truth)
        return _Builtin(score, builtin_extras(data_source, response, ground_truth, self.cfg.gsm8k_method))

    def _check(self, value: Any, row: int, data_source: str) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not _math.isfinite(number):
            raise RewardError(f"{self.fn_name} returned score={value!r} for row {row} "
                              f"(data_source={data_source!r}); it must return a finite float or a "
                              "dict with a finite 'score'")
        return number

    def score_batch(self, responses: Sequence[str], data_sources: Sequence[str],
                    ground_truths: Sequence[Any], extra_infos: Optional[Sequence[dict]] = None
                    ) -> Tuple[torch.Tensor, Dict[str, List[Any]]]:
        """(scores [B], extra metrics {key: [B values or None]}) of one batch of responses."""
        n = len(responses)
        extra_infos = [{}] * n if extra_infos is None else list(extra_infos)
        if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
            raise RewardError(f"reward inputs differ in length: {n} responses, {len(data_sources)} "
                              f"data_sources, {len(ground_truths)} ground_truths, "
                              f"{len(extra_infos)} extra_infos")
        scores, extra = [], {}
        for i, (resp, src, truth, info) in enumerate(zip(responses, data_sources, ground_truths,
                                                         extra_infos)):
            value = self._raw_score(resp, src, truth, info)
            # the per-response values beside the score, as verl's reward managers keep them: a dict's every key
            # ("score" too), else "acc" = the score (a built-in's own "acc", where it has one, wins)
            if isinstance(value, dict):
                if "score" not in value:
                    raise RewardError(f"{self.fn_name} returned a dict without 'score' for row {i} "
                                      f"(data_source={src!r}); add the key 'score'")
                score, values = self._check(value["score"], i, src), value
            else:
                raw, own = (value.score, value.extras) if isinstance(value, _Builtin) else (value, {})
                score = self._check(raw, i, src)
                values = {"acc": score, **own}
            for key, v in values.items():  # passed through as metrics, unchecked (may be text)
                extra.setdefault(key, [None] * n)[i] = v
            scores.append(score)
        return torch.tensor(scores, dtype=torch.float32), extra

    def __call__(self, responses: Sequence[str], data_sources: Sequence[str],
                 ground_truths: Sequence[Any], extra_infos: Optional[Sequence[dict]] = None
                 ) -> torch.Tensor:
        return self.score_batch(responses, data_sources, ground_truths, extra_infos)[0]


def combine_scores(rule_scores: Optional[torch.Tensor], rm_scores: torch.Tensor, mode: str) -> torch.Tensor:
    """The training score of each response from the reward model's score: `replace` takes it as is
    (rule_scores may be None), `add` adds the row's rule score (per data_source) to it."""
    if mode == "replace":
        return rm_scores.float()
    if mode != "add":
        raise RewardError(f"reward_model.combine={mode!r} is not one of replace, add")
    if rule_scores is None or rule_scores.shape != rm_scores.shape:
        shape = None if rule_scores is None else list(rule_scores.shape)
        raise RewardError(f"reward_model.combine=add needs one rule score per response: got {shape} "
                          f"for {list(rm_scores.shape)} reward-model scores")
    return rule_scores.float().to(rm_scores.device) + rm_scores.float()
