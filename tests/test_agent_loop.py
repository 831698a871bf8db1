"""The agent loop: trajectories of model turns and tool results, masks, counters, budget, seeds.

The engine here is `ScriptedEngine`, a complete RolloutEngine whose replies are a function of the
context text and the row's seed (what a policy is), so every branch of the loop can be driven on
purpose. The loop against the real native engine and the trainer's log-probs is in test_sft.py,
where a model that has learned to call the tool exists.
"""
import json
import os
import random

import pytest
import torch

from hybridrl import algos
from hybridrl.config import MultiTurnConfig
from hybridrl.data.tool_demos import tool_call_text
from hybridrl.rollout.agent_loop import (AgentLoop, trajectory_fields, trajectory_shapes, turn_metrics, turn_sums,
                                        verl_num_turns)
from hybridrl.rollout.base import SamplingParams, expand_requests, pack_output
from hybridrl.trainer.step_batch import assemble
from hybridrl.tokenizer import TINY_TOOLS_SPEC, load_tokenizer

TOK = load_tokenizer(TINY_TOOLS_SPEC)
EOS = TOK.eos_token_id


class ScriptedEngine:
    """generate() over `reply(context_text, seed) -> (text, ends_with_eos)`; log-prob of a token is
    -(id + 1) / 1000, so a log-prob stored at the wrong position shows."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def generate(self, prompt_token_ids, sampling, prompt_seeds=None):
        self.calls.append((len(prompt_token_ids), sampling))
        tokens = []
        for prompt, seed in expand_requests(prompt_token_ids, sampling, prompt_seeds):
            text, stop = self.reply(TOK.decode(prompt, skip_special_tokens=False), seed)
            tokens.append((TOK.encode(text) + ([EOS] if stop else []))[:sampling.max_new_tokens])
        log_probs = [[-(t + 1) / 1000 for t in row] for row in tokens]
        return pack_output(tokens, log_probs, sampling.max_new_tokens, TOK.pad_token_id,
                           {"rollout/generated_tokens": sum(map(len, tokens))})

    def load_weights(self, weights):
        return {}

    def sleep(self):
        pass

    def wake_up(self):
        pass


def last_tool_response(context):
    return context.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]


def calls_then_copies(context, seed):
    """The policy the demo teaches: call the calculator on the prompt, then copy its result."""
    if "</tool_response>" in context:
        return last_tool_response(context), True
    return tool_call_text(context.split("=")[0]), True


def _loop(reply, max_turns=3, **cfg):
    engine = ScriptedEngine(reply)
    return AgentLoop(MultiTurnConfig(enable=True, max_turns=max_turns, **cfg), TOK), engine


def _text(ids, mask):
    return TOK.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m], skip_special_tokens=False)


def test_call_result_answer_in_order_with_masks():
    loop, engine = _loop(calls_then_copies)
    out = loop.generate(engine, [TOK.encode("23*17=")], SamplingParams(max_new_tokens=90))
    call = TOK.encode(tool_call_text("23*17")) + [EOS]
    result = TOK.encode("<tool_response>391</tool_response>")
    answer = TOK.encode("391") + [EOS]
    n = len(call) + len(result) + len(answer)
    assert out.responses[0, :n].tolist() == call + result + answer
    assert out.response_mask[0].tolist() == [1] * len(call) + [0] * len(result) + [1] * len(answer) + [0] * (90 - n)
    assert out.attention_mask[0].tolist() == [1] * n + [0] * (90 - n)
    assert _text(out.responses[0], out.last_turn_mask[0]) == "391<eos>"
    expected_lp = [-(t + 1) / 1000 for t in call] + [0.0] * len(result) + [-(t + 1) / 1000 for t in answer]
    assert torch.allclose(out.log_probs[0, :n], torch.tensor(expected_lp)) and not out.log_probs[0, n:].any()
    assert (out.num_turns.tolist(), out.tool_calls.tolist(), out.tool_errors.tolist()) == ([2], [1], [0])
    # every rank makes max_turns calls with one SamplingParams (collective rollout-TP groups)
    assert [(rows, s.max_new_tokens, s.n) for rows, s in engine.calls] == [(1, 90, 1), (1, 90, 1), (0, 90, 1)]


def test_bad_calls_become_error_messages_and_are_counted():
    def reply(context, seed):
        if context.count("<tool_response>") == 0:
            return '<tool_call>{"name": "calculator", "arguments": {"expression": "2*"}}</tool_call>', True
        if context.count("<tool_response>") == 1:
            return '<tool_call>{"name": "search", "arguments": {}}</tool_call>', True
        return "6", True

    loop, engine = _loop(reply, max_turns=3)
    out = loop.generate(engine, [TOK.encode("2*3=")], SamplingParams(max_new_tokens=300))
    tool_text = _text(out.responses[0], out.attention_mask[0] - out.response_mask[0])
    # (builtin:tiny_tools lowercases what it encodes)
    assert "not an arithmetic expression: '2*'" in tool_text and "error: unknown tool 'search'" in tool_text
    assert (out.num_turns.tolist(), out.tool_calls.tolist(), out.tool_errors.tolist()) == ([3], [2], [2])
    assert _text(out.responses[0], out.last_turn_mask[0]) == "6<eos>"


@pytest.mark.parametrize("timeout_s,expected", [(0.2, "error: tool 'sleeps' timed out after 0.2 s"), (5, "late")])
def test_tool_timeout_key(timeout_s, expected):
    """rollout.multi_turn.tool_timeout_s from the config tree: a tool of 0.6 s is abandoned at 0.2 s and
    answered within 5 s."""
    from hybridrl.config.io import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "tiny_cpu_tools.yaml"), [
        f"rollout.multi_turn.tool_timeout_s={timeout_s}", "rollout.multi_turn.tools=[test_tools:sleeps]"])

    def reply(context, seed):
        if "</tool_response>" in context:
            return "1", True
        return '<tool_call>{"name": "sleeps", "arguments": {"seconds": 0.6}}</tool_call>', True

    engine = ScriptedEngine(reply)
    loop = AgentLoop(cfg.rollout.multi_turn, TOK)
    out = loop.generate(engine, [TOK.encode("1=")], SamplingParams(max_new_tokens=300))
    tool_text = _text(out.responses[0], out.attention_mask[0] - out.response_mask[0])
    assert tool_text == f"<tool_response>{expected}</tool_response>"
    assert out.tool_errors.tolist() == [int(timeout_s < 0.6)]


def test_calls_of_the_last_turn_and_of_cut_turns_are_not_run():
    always_calls = lambda context, seed: (tool_call_text("1+1"), True)
    loop, engine = _loop(always_calls, max_turns=2)
    out = loop.generate(engine, [TOK.encode("1+1=")], SamplingParams(max_new_tokens=300))
    assert (out.num_turns.tolist(), out.tool_calls.tolist()) == ([2], [1])

    no_eos = lambda context, seed: (tool_call_text("1+1"), False)  # cut by the budget, no eos
    loop, engine = _loop(no_eos)
    out = loop.generate(engine, [TOK.encode("1+1=")], SamplingParams(max_new_tokens=300))
    assert (out.num_turns.tolist(), out.tool_calls.tolist()) == ([1], [0])


def test_budget_bounds_the_whole_trajectory():
    call = len(TOK.encode(tool_call_text("23*17"))) + 1
    result = len(TOK.encode("<tool_response>391</tool_response>"))
    loop, engine = _loop(calls_then_copies)
    # the result fits but leaves no room for an answer: the trajectory ends after the call (as verl)
    out = loop.generate(engine, [TOK.encode("23*17=")], SamplingParams(max_new_tokens=call + result))
    assert out.attention_mask.sum().item() == call and out.num_turns.tolist() == [1]
    # one token of room after the result: the answer is cut to it
    out = loop.generate(engine, [TOK.encode("23*17=")], SamplingParams(max_new_tokens=call + result + 1))
    assert out.attention_mask.sum().item() == call + result + 1 and out.num_turns.tolist() == [2]
    assert _text(out.responses[0], out.last_turn_mask[0]) == "3"


def random_policy(context, seed):
    """Seeded choices between calling (well or badly), answering and rambling past the budget."""
    rng = random.Random(seed)
    kind = rng.choice(["call", "call", "bad", "answer", "ramble"])
    if kind == "call":
        return tool_call_text(f"{rng.randint(1, 99)}*{rng.randint(1, 99)}"), True
    if kind == "bad":
        return "<tool_call>{oops</tool_call>", True
    if kind == "answer":
        return str(rng.randint(0, 9999)), True
    return "7" * rng.randint(1, 150), False


def test_trajectories_do_not_depend_on_the_batch():
    prompts = [TOK.encode(f"{a}*{b}=") for a, b in ((12, 34), (56, 78), (90, 11), (23, 45))]
    seeds = [101, 202, 303, 404]
    sampling = SamplingParams(n=3, max_new_tokens=160)
    loop, engine = _loop(random_policy, max_turns=4)
    whole = loop.generate(engine, prompts, sampling, seeds)
    halves = [loop.generate(engine, prompts[i:i + 2], sampling, seeds[i:i + 2]) for i in (0, 2)]
    for name in ("responses", "response_mask", "attention_mask", "log_probs", "last_turn_mask", "num_turns",
                 "tool_calls", "tool_errors"):
        assert torch.equal(getattr(whole, name), torch.cat([getattr(h, name) for h in halves])), name
    assert whole.num_turns.max() > 2 and whole.tool_errors.sum() > 0 and whole.tool_calls.sum() > whole.tool_errors.sum()
    assert len({tuple(r) for r in whole.responses.tolist()}) >= 10  # seeds differ per (prompt, sample, turn)
    assert all(s.max_new_tokens == 160 and s.n == 1 for _, s in engine.calls[1:4])


def test_batch_masks_and_turn_metrics():
    loop, engine = _loop(random_policy, max_turns=3)
    prompts = [TOK.encode("12*34="), TOK.encode("5*6=")]
    out = loop.generate(engine, prompts, SamplingParams(n=2, max_new_tokens=120), [7, 8])
    R = 128
    pad = lambda t: torch.cat([t, t.new_zeros(t.shape[0], R - t.shape[1])], dim=1)
    prompt_ids = torch.tensor([[0, 0] + prompts[0], [0] * 4 + prompts[1]])
    fields = trajectory_fields(out, R, "cpu")
    assert torch.equal(fields["attention_mask"], pad(out.attention_mask))
    # what the model-parallel peers allocate to receive the broadcast is what the source sends
    assert {k: (tuple(v.shape), v.dtype) for k, v in fields.items()} == trajectory_shapes(4, R)
    batch = assemble(prompt_ids, (prompt_ids != 0).float(), pad(out.responses), pad(out.response_mask), 2,
                     response_attention_mask=fields.pop("attention_mask"))
    batch.update(fields)
    P = prompt_ids.shape[1]
    assert torch.equal(batch["attention_mask"][:, P:], pad(out.attention_mask))
    assert torch.equal(batch["response_mask"], pad(out.response_mask))
    assert batch["last_turn_mask"].shape == (4, R) and (batch["last_turn_mask"] <= batch["response_mask"]).all()
    sums = turn_sums(batch)
    metrics = turn_metrics(sums)
    for key, counts in (("num_turns", out.num_turns), ("tool_calls", out.tool_calls), ("tool_errors", out.tool_errors)):
        assert metrics[f"rollout/{key}/mean"] == pytest.approx(counts.double().mean().item())
    assert turn_sums({"responses": batch["responses"]}) == {} and turn_metrics({}) == {}


def test_reward_functions_get_verls_turn_count_in_extra_info(tmp_path):
    """verl's reward managers set extra_info["num_turns"] to the agent loop's __num_turns__ (prompt + model turns
    + tool-result rounds; 2 for one turn) and extra_info["rollout_reward_scores"]; a user's function sees both
    here too, beside the dataset's own keys (by hand: answer at once 2, call then answer 4, two parallel calls
    in one round then answer 4, call, call, answer 6)."""
    from types import SimpleNamespace

    from hybridrl.config import RewardConfig
    from hybridrl.config.reward import CustomRewardConfig
    from hybridrl.rewards.registry import RewardManager
    from hybridrl.trainer.ppo import PPOTrainer

    scripts = {"1+1=": ["2"], "2*3=": [tool_call_text("2*3"), "6"],
               "4*5=": [tool_call_text("4*5") + tool_call_text("5*4"), "20"],
               "6*7=": [tool_call_text("6*7"), tool_call_text("7*6"), "42"]}

    def reply(context, seed):
        prompt = next(p for p in scripts if p in context)
        rounds = context.count("<tool_response>") if prompt != "4*5=" else min(1, context.count("<tool_response>"))
        return scripts[prompt][min(rounds, len(scripts[prompt]) - 1)], True

    loop, engine = _loop(reply, max_turns=4, max_parallel_calls=2)
    prompts = [TOK.encode(p) for p in scripts]
    out = loop.generate(engine, prompts, SamplingParams(max_new_tokens=500))
    assert out.num_turns.tolist() == [1, 2, 2, 3] and out.tool_calls.tolist() == [0, 1, 2, 2]
    R, P = 512, max(map(len, prompts))
    pad = lambda t: torch.cat([t, t.new_zeros(t.shape[0], R - t.shape[1])], dim=1)  # noqa: E731
    prompt_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    fields = trajectory_fields(out, R, "cpu")
    batch = assemble(prompt_ids, (prompt_ids != 0).float(), pad(out.responses), pad(out.response_mask), 1,
                     response_attention_mask=fields.pop("attention_mask"))
    batch.update(fields)
    assert verl_num_turns(batch, batch["attention_mask"][:, P:]) == [2, 4, 4, 6]
    single = {"response_mask": batch["response_mask"]}
    assert verl_num_turns(single, batch["attention_mask"][:, P:]) == [2, 2, 2, 2]

    (tmp_path / "seen.py").write_text("SEEN = []\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                      "    SEEN.append(extra_info)\n    return 1.0\n")
    manager = RewardManager(RewardConfig(custom_function=CustomRewardConfig(path=str(tmp_path / "seen.py"), name="score")))
    cfg = SimpleNamespace(reward_model=SimpleNamespace(combine="replace"),
                          reward=SimpleNamespace(overlong_buffer=SimpleNamespace(enable=False)))
    trainer = SimpleNamespace(tok=TOK, roles=SimpleNamespace(reward_model=None), cfg=cfg, reward_fn=manager,
                              groups=SimpleNamespace(device=torch.device("cpu"), replica_size=1))
    rows = SimpleNamespace(data_source=["tools"] * 4, ground_truth=["2", "6", "20", "42"],
                           extra_info=[{"index": i} for i in range(4)])
    PPOTrainer.score_details(trainer, batch, rows, 1)
    seen = manager.custom_fn.__globals__["SEEN"]
    assert seen == [{"index": i, "num_turns": t, "rollout_reward_scores": {}} for i, t in enumerate([2, 4, 4, 6])]
    assert rows.extra_info == [{"index": i} for i in range(4)]  # the dataset's rows are left as they were


# ---- GAE across tool output: against verl 0.9.1's compute_gae_advantage_return -------------------

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_reference", "gae_holes_verl_0_9_1.json")


@pytest.mark.parametrize("case", range(3))
def test_gae_with_holes_equals_verl(case):
    with open(REFERENCE) as f:
        ref = json.load(f)
    mask = torch.tensor(ref["response_mask"], dtype=torch.float64)
    rewards = torch.tensor(ref["token_level_rewards"], dtype=torch.float64)
    values = torch.tensor(ref["values"], dtype=torch.float64)
    c = ref["cases"][case]
    adv, returns = algos.compute_gae_advantages(rewards, values, mask, c["gamma"], c["lam"])
    expected_adv = torch.tensor(c["advantages"], dtype=torch.float64)
    # the recursion itself: returns are the raw advantages + values, equal to float64 rounding
    assert torch.allclose(returns, torch.tensor(c["returns"], dtype=torch.float64), rtol=0, atol=1e-12)
    # whitened advantages, equal where the loss reads them (hybridrl zeroes them outside the mask, verl
    # leaves them); verl's masked_mean divides by mask.sum() + 1e-8, hence ~1e-10 apart, not 1e-12
    assert torch.allclose(adv * mask, expected_adv * mask, rtol=0, atol=1e-9)
    assert not (adv * (1 - mask)).any()
