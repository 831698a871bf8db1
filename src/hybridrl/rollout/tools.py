"""Tools for multi-turn rollouts: the built-in calculator, Hermes tool-call parsing, safe execution.

A model calls a tool by writing, in the Hermes / Qwen2.5 format,
    <tool_call>{"name": "calculator", "arguments": {"expression": "23*17"}}</tool_call>
`parse_tool_calls(text)` finds these blocks; `ToolSet.call(call)` runs one and always returns a
`ToolResult` (text for the model, `error` set when the call was bad): unparseable JSON, an unknown
tool, bad arguments, a tool that raises or runs past its timeout. Nothing here raises into the
rollout. Tools are plain functions `fn(**arguments) -> str`, named in config as `module:function`
(or `calculator`, the built-in). This module knows nothing about tokens or engines.
"""
from __future__ import annotations

import ast
import importlib
import json
import math
import operator
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

from hybridrl.config import ConfigError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

# ---- the built-in calculator --------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_ABS_RESULT = 1e100
MAX_EXPONENT = 100
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says why."""


def _bounded(x):
    if (isinstance(x, float) and not math.isfinite(x)) or abs(x) > MAX_ABS_RESULT:
        raise CalculatorError(f"result out of range (|x| > {MAX_ABS_RESULT:g})")
    return x


def _power(base, exponent):
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is too large (limit {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise CalculatorError("zero to a negative power")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_ABS_RESULT):
        raise CalculatorError(f"result out of range (|x| > {MAX_ABS_RESULT:g})")
    result = base ** exponent
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power")
    return result


def _evaluate(node):
    """Walk the parsed expression: numbers, + - * / ** and unary signs only."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise CalculatorError(f"unsupported element {type(node).__name__}; use numbers, + - * / ** and ( )")


def format_number(x) -> str:
    """Integers (and integral floats) without a decimal point, other floats with up to 12 digits."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.12g}" if isinstance(x, float) else str(x)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / ** and parentheses (never `eval`)."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from e
    return format_number(_evaluate(tree))


BUILTIN_TOOLS: Dict[str, Callable[..., str]] = {"calculator": calculator}

# ---- parsing and running tool calls ---------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `error` is set (and name/arguments may be empty) when the block was bad."""
    name: str
    arguments: dict
    error: str = ""


@dataclass(frozen=True)
class ToolResult:
    text: str
    """What the model reads back as the tool message."""
    error: bool = False
    """True for a bad call (unparseable, unknown tool, bad arguments, raised, timed out)."""


def _parse_block(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a tool call must be {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, "the tool call's arguments must be a JSON object")
    return ToolCall(obj["name"], arguments)


def parse_tool_calls(text: str) -> List[ToolCall]:
    """Every <tool_call>...</tool_call> block of a model turn, in order; an unclosed one is an error."""
    calls = [_parse_block(m.group(1).strip()) for m in _TOOL_CALL.finditer(text)]
    tail = _TOOL_CALL.sub("", text)
    if TOOL_CALL_OPEN in tail:
        calls.append(ToolCall("", {}, f"unterminated {TOOL_CALL_OPEN}: close it with {TOOL_CALL_CLOSE}"))
    return calls


def resolve_tool(entry: str) -> tuple[str, Callable[..., str]]:
    """(name, function) of a config entry: a built-in name or `package.module:function`."""
    if entry in BUILTIN_TOOLS:
        return entry, BUILTIN_TOOLS[entry]
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"rollout.multi_turn.tools entry {entry!r} is neither a built-in "
                          f"({', '.join(BUILTIN_TOOLS)}) nor 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rollout.multi_turn.tools entry {entry!r} cannot be loaded ({type(e).__name__}: "
                          f"{e}); put the module on PYTHONPATH or fix the entry") from e
    if not callable(fn):
        raise ConfigError(f"rollout.multi_turn.tools entry {entry!r} is not a function")
    return attr, fn


class _Running:
    """One tool call in its own daemon thread. A thread cannot be killed: a call past its timeout
    keeps running in the background, detached, and its result is ignored."""

    def __init__(self, fn: Callable, arguments: dict):
        self.box: dict = {}
        self.thread = threading.Thread(target=self._target, args=(fn, arguments), daemon=True,
                                       name="hybridrl-tool")
        self.thread.start()

    def _target(self, fn, arguments):
        try:
            self.box["value"] = fn(**arguments)
        except BaseException as e:  # whatever the tool raises is reported to the model
            self.box["error"] = e

    def wait(self, deadline: float):
        """('ok', value) / ('raised', exception) / ('timeout', None)."""
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            return "timeout", None
        return ("raised", self.box["error"]) if "error" in self.box else ("ok", self.box.get("value"))


class ToolSet:
    """The tools of a run, by name; `call_many` never raises."""

    def __init__(self, entries: Sequence[str], timeout_s: float = 10.0, max_response_chars: int = 256):
        self.tools = dict(resolve_tool(e) for e in entries)
        self.timeout_s, self.max_response_chars = timeout_s, max_response_chars

    def _truncate(self, text: str) -> str:
        limit = self.max_response_chars
        return text if len(text) <= limit else text[:limit] + "...(truncated)"

    def _refusal(self, call: ToolCall) -> ToolResult | None:
        if call.error:
            return ToolResult(f"error: {call.error}", True)
        if call.name not in self.tools:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(f"error: unknown tool {call.name!r}; available: {known}", True)
        return None

    def _result(self, call: ToolCall, status: str, value) -> ToolResult:
        if status == "timeout":
            return ToolResult(f"error: tool {call.name!r} timed out after {self.timeout_s:g} s", True)
        if status == "raised":
            if isinstance(value, TypeError):  # most often arguments the function does not take
                return ToolResult(f"error: bad arguments for {call.name!r}: {value}", True)
            return ToolResult(f"error: {type(value).__name__}: {value}", True)
        return ToolResult(value if isinstance(value, str) else json.dumps(value, default=str))

    def call_many(self, calls: Sequence[ToolCall]) -> List[ToolResult]:
        """Run the calls concurrently (one thread each), all bounded by one timeout; results in order,
        each (error messages too) cut to max_response_chars as verl's max_tool_response_length."""
        refusals = [self._refusal(c) for c in calls]
        running = [None if r is not None else _Running(self.tools[c.name], c.arguments)
                   for c, r in zip(calls, refusals)]
        deadline = time.monotonic() + self.timeout_s
        results = [r if r is not None else self._result(c, *job.wait(deadline))
                   for c, r, job in zip(calls, refusals, running)]
        return [ToolResult(self._truncate(r.text), r.error) for r in results]
