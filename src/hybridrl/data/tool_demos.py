"""The synthetic tool-use task of the CPU tools demo: two-digit multiplication with a calculator.

Prompts are "23*17=" (data_source "synthetic/arith_tools", ground truth "391", scored 1/0 by
`rewards.arith.compute_exact_score` on the final answer). A tiny model cannot multiply, but it can
learn to call the calculator and copy its result:

    23*17= <tool_call>{"name": "calculator", "arguments": {"expression": "23*17"}}</tool_call><eos>
           <tool_response>391</tool_response> 391<eos>

`demonstration_rows` writes that conversation as chat messages (user, assistant, tool, assistant)
for the SFT warm-up; the tool message is what the built-in calculator returns.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any, Dict, List

from hybridrl.data.prompts import write_prompt_parquet
from hybridrl.rollout.tools import calculator

TOOLS_SOURCE = "synthetic/arith_tools"
MIN_OPERAND, MAX_OPERAND = 32, 99  # products have four digits: the answer always has one length


def _problems(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        a, b = rng.randint(MIN_OPERAND, MAX_OPERAND), rng.randint(MIN_OPERAND, MAX_OPERAND)
        yield a, b, f"{a}*{b}"


def tool_call_text(expression: str) -> str:
    """The Hermes tool call of the calculator on `expression`."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def arith_tools_rows(n: int, seed: int, split: str) -> List[Dict[str, Any]]:
    """RL prompts a*b= in verl's layout."""
    return [{"data_source": TOOLS_SOURCE, "prompt": [{"role": "user", "content": f"{expr}="}], "ability": "arith",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)},
             "extra_info": {"split": split, "index": i, "a": a, "b": b}}
            for i, (a, b, expr) in enumerate(_problems(n, seed))]


def demonstration_rows(n: int, seed: int) -> List[Dict[str, Any]]:
    """SFT trajectories: the prompt, the calculator call, its result, the answer."""
    rows = []
    for a, b, expr in _problems(n, seed):
        result = calculator(expr)
        rows.append({"data_source": TOOLS_SOURCE, "messages": [
            {"role": "user", "content": f"{expr}="},
            {"role": "assistant", "content": tool_call_text(expr)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result}]})
    return rows


def write_demonstrations(path: str, n: int = 2000, seed: int = 7) -> str:
    """A parquet file of `n` demonstration trajectories (atomic write)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_prompt_parquet(demonstration_rows(n, seed), path)
