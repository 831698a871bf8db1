"""Tools of multi-turn rollouts: the safe calculator, Hermes tool-call parsing, ToolSet error handling."""
import time

import pytest

from hybridrl.config import ConfigError, MultiTurnConfig
from hybridrl.rollout.tools import CalculatorError, ToolSet, calculator, parse_tool_calls, resolve_tool


# tools loaded by 'module:function' entries (this test module is importable: tests/ is on sys.path)
def echo(text: str) -> str:
    return text


def raises(**_):
    raise RuntimeError("backend down")


def sleeps(seconds: float = 5.0) -> str:
    time.sleep(seconds)
    return "late"


def returns_dict(x: int) -> dict:
    return {"x": x}


@pytest.mark.parametrize("expression,expected", [
    ("23*17", "391"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-7+2", "-5"), ("7/2", "3.5"), ("8/2", "4"),
    ("2**10", "1024"), (" 10 - 3 ", "7"), ("1.5*2", "3"), ("1/3", "0.333333333333"), ("-(2**3)", "-8"),
])
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression,fragment", [
    ("__import__('os').system('true')", "unsupported element Call"),
    ("x+1", "unsupported element Name"),
    ("'a'*3", "unsupported element Constant"),
    ("[1]*3", "unsupported element List"),
    ("(lambda: 1)()", "unsupported element"),
    ("1/0", "division by zero"),
    ("0**-1", "zero to a negative power"),
    ("9**9**9", "too large"),
    ("10**99*10**99", "out of range"),
    ("(-8)**0.5", "fractional power"),
    ("2+", "not an arithmetic expression"),
    ("1" * 201, "longer than 200"),
    ("7 % 2", "unsupported element BinOp"),
])
def test_calculator_refuses(expression, fragment):
    with pytest.raises(CalculatorError, match=fragment.replace("*", r"\*")):
        calculator(expression)


def test_calculator_longest_nesting_evaluates():
    assert calculator("-" * 199 + "1") == "-1"  # 200 characters of unary signs: no recursion trouble
    assert calculator("(" * 99 + "2" + ")" * 99) == "2"


def test_parse_hermes_calls_in_order():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>\n'
            '<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, ""), ("echo", {"text": "hi"}, "")]
    assert parse_tool_calls("just an answer: 6") == []


@pytest.mark.parametrize("text,fragment", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"arguments": {}}</tool_call>', '{"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "unterminated <tool_call>"),
])
def test_parse_bad_blocks_become_errors(text, fragment):
    (call,) = parse_tool_calls(text)
    assert fragment in call.error


def test_toolset_results_and_errors():
    tools = ToolSet(["calculator", "test_tools:echo", "test_tools:raises", "test_tools:returns_dict"],
                    timeout_s=5.0, max_response_chars=60)
    calls = parse_tool_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "23*17"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "raises", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "echo", "arguments": {"text": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxyz"}}</tool_call>'
        '<tool_call>{"name": "returns_dict", "arguments": {"x": 3}}</tool_call>'
        '<tool_call>{oops}</tool_call>')
    results = tools.call_many(calls)
    assert [r.error for r in results] == [False, True, True, True, True, False, False, True]
    assert results[0].text == "391"
    assert "division by zero" in results[1].text
    assert "bad arguments for 'calculator'" in results[2].text
    assert "unknown tool 'search'" in results[3].text and "calculator" in results[3].text
    assert results[4].text == "error: RuntimeError: backend down"
    assert results[5].text == "x" * 60 + "...(truncated)"  # cut to 60 characters
    assert results[6].text == '{"x": 3}'
    assert "not valid JSON" in results[7].text
    long_error = ToolSet(["test_tools:raises"], max_response_chars=12).call_many(calls[4:5])[0]
    assert long_error.error and long_error.text == "error: Runti...(truncated)"  # errors are cut too


def test_toolset_timeout_does_not_wait_for_the_tool():
    tools = ToolSet(["test_tools:sleeps"], timeout_s=0.2)
    start = time.monotonic()
    (result,) = tools.call_many(parse_tool_calls('<tool_call>{"name": "sleeps", "arguments": {}}</tool_call>'))
    assert result.error and "timed out after 0.2 s" in result.text
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("entry,fragment", [
    ("no_such_module_xyz:fn", "cannot be loaded"),
    ("test_tools:missing", "cannot be loaded"),
    ("test_tools:pytest", "is not a function"),
    ("search", "neither a built-in"),
])
def test_bad_tool_entries_fail_at_start(entry, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve_tool(entry)


def test_multi_turn_config_checks_entries():
    with pytest.raises(ConfigError, match="rollout.multi_turn.tools entry 'a:b:c'"):
        MultiTurnConfig(tools=["a:b:c"])
    with pytest.raises(ConfigError, match="max_turns"):
        MultiTurnConfig(max_turns=0)
