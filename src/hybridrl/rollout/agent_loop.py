"""Multi-turn rollouts with tool calls, on any engine through `generate` alone.

A trajectory is the prompt, then model turns and tool results in order:

    prompt | model turn 1 (ends with eos) | tool result(s) | model turn 2 | ... | final model turn

The response part holds model tokens (response_mask 1, with their rollout log-probs) and tool-result
tokens (response_mask 0, log-prob 0); both are real tokens (attention_mask 1). A turn that ends
with eos and holds <tool_call> blocks gets the tool results appended (rendered by the tokenizer's
`continuation_text`, which also ends with the next assistant header) and the model continues;
otherwise the trajectory is finished. The whole response fits in `sampling.max_new_tokens`.

Each turn batches all unfinished trajectories into one `engine.generate` call. Turn 1 is exactly
the single-turn rollout (`n` samples per prompt, seeds from `prompt_seeds`); later turns use one
sample per trajectory with a seed derived from (prompt seed, sample, turn), so what is sampled
never depends on the batch or the parallel layout. Every rank makes exactly `max_turns` calls
with the same sampling parameters (no requests once its trajectories are done), because engines
with rollout TP > 1 decode their group's requests as one collective batch; a later turn may
therefore decode past a trajectory's remaining room, and what does not fit is dropped. Nothing
here knows an engine's internals or torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List

import torch

from hybridrl.config import MultiTurnConfig
from hybridrl.rollout.base import RolloutOutput, SamplingParams, sample_seed
from hybridrl.rollout.tools import ToolSet, parse_tool_calls


@dataclass
class AgentOutput(RolloutOutput):
    """A RolloutOutput whose responses are whole trajectories, plus per-trajectory counters [N*n]."""
    last_turn_mask: torch.Tensor | None = None
    """float [N*n, R]: 1 on the final model turn (what the reward scores)."""
    num_turns: torch.Tensor | None = None
    """Model turns of each trajectory."""
    tool_calls: torch.Tensor | None = None
    """Tool calls run for each trajectory (bad ones included)."""
    tool_errors: torch.Tensor | None = None
    """Bad calls (unparseable, unknown tool, bad arguments, raised, timed out) of each trajectory."""


@dataclass
class Trajectory:
    prompt: List[int]
    seed: int
    """Sample seed of (prompt, sample): turn 1 used it, later turns derive theirs from it."""
    tokens: List[int] = field(default_factory=list)
    is_model: List[bool] = field(default_factory=list)
    log_probs: List[float] = field(default_factory=list)
    last_turn_start: int = 0
    turns: int = 0
    calls: int = 0
    errors: int = 0
    done: bool = False


def turn_seed(trajectory_seed: int, turn: int) -> int:
    """Seed of a trajectory's turn >= 2 (turn 1 is the engine's own sample seed)."""
    return sample_seed(trajectory_seed, turn)


class AgentLoop:
    def __init__(self, cfg: MultiTurnConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.tools = ToolSet(cfg.tools, cfg.tool_timeout_s, cfg.max_tool_response_length)
        # a template that cannot render tool messages fails here, before any rollout
        tokenizer.continuation_text([{"role": "tool", "content": "0"}])

    def generate(self, engine, prompt_token_ids: List[List[int]], sampling: SamplingParams,
                 prompt_seeds: List[int] | None = None) -> AgentOutput:
        if prompt_seeds is None:
            prompt_seeds = [sampling.seed + i for i in range(len(prompt_token_ids))]
        trajectories = [Trajectory(list(p), sample_seed(s, j)) for p, s in zip(prompt_token_ids, prompt_seeds)
                        for j in range(sampling.n)]
        stops = set(sampling.stop_token_ids) | {self.tok.eos_token_id}
        budget = sampling.max_new_tokens
        stats: Dict[str, float] = {}
        out = engine.generate(prompt_token_ids, sampling, prompt_seeds)
        self._add_turn(trajectories, out, 1, stops, budget, stats)
        later = replace(sampling, n=1)  # the full budget: every rank of a rollout-TP group must agree
        for turn in range(2, self.cfg.max_turns + 1):
            active = [t for t in trajectories if not t.done]
            out = engine.generate([t.prompt + t.tokens for t in active], later,
                                  [turn_seed(t.seed, turn) for t in active])
            self._add_turn(active, out, turn, stops, budget, stats)
        return pack_trajectories(trajectories, budget, self.tok.pad_token_id, stats)

    def _add_turn(self, trajectories: List[Trajectory], out: RolloutOutput, turn: int, stops: set,
                  budget: int, stats: Dict[str, float]) -> None:
        for key, value in out.stats.items():
            stats[key] = stats.get(key, 0) + value
        for row, t in enumerate(trajectories):
            length = int(out.response_mask[row].sum())
            room = budget - len(t.tokens)
            tokens = out.responses[row, :min(length, room)].tolist()
            t.last_turn_start, t.turns = len(t.tokens), turn
            t.tokens += tokens
            t.is_model += [True] * len(tokens)
            t.log_probs += out.log_probs[row, :len(tokens)].tolist()
            stopped = bool(tokens) and tokens[-1] in stops
            t.done = not stopped or turn == self.cfg.max_turns or not self._run_tools(t, tokens, budget)

    def _run_tools(self, t: Trajectory, turn_tokens: List[int], budget: int) -> bool:
        """Run the turn's tool calls and append their results; False when the trajectory is finished."""
        calls = parse_tool_calls(self.tok.decode(turn_tokens))[:self.cfg.max_parallel_calls]
        if not calls:
            return False  # a final answer
        results = self.tools.call_many(calls)
        t.calls += len(results)
        t.errors += sum(r.error for r in results)
        ids = self.tok.encode(self.tok.continuation_text([{"role": "tool", "content": r.text} for r in results]))
        if len(t.tokens) + len(ids) >= budget:
            return False  # no room left for the model to read the result and answer (as verl)
        t.tokens += ids
        t.is_model += [False] * len(ids)
        t.log_probs += [0.0] * len(ids)
        return True


def pack_trajectories(trajectories: List[Trajectory], width: int, pad_id: int, stats: dict) -> AgentOutput:
    """Right-padded [rows, width] tensors of the trajectories' response parts."""
    rows = len(trajectories)
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    loss_mask, attention, log_probs, last_turn = (torch.zeros(rows, width) for _ in range(4))
    for r, t in enumerate(trajectories):
        n = len(t.tokens)
        if n:
            responses[r, :n] = torch.tensor(t.tokens, dtype=torch.long)
            loss_mask[r, :n] = torch.tensor(t.is_model, dtype=torch.float32)
            log_probs[r, :n] = torch.tensor(t.log_probs, dtype=torch.float32)
        attention[r, :n] = 1.0
        last_turn[r, t.last_turn_start:n] = 1.0
    counters = {name: torch.tensor([float(getattr(t, name)) for t in trajectories])
                for name in ("turns", "calls", "errors")}
    return AgentOutput(responses, loss_mask, log_probs, dict(stats), attention_mask=attention,
                       last_turn_mask=last_turn, num_turns=counters["turns"], tool_calls=counters["calls"],
                       tool_errors=counters["errors"])


# ---- what the trainer keeps in its batch and reports ------------------------------------------------

TURN_KEYS = ("num_turns", "tool_calls", "tool_errors")


def trajectory_fields(out: AgentOutput, width: int, device) -> Dict[str, torch.Tensor]:
    """Batch entries of a multi-turn rollout beside the usual ones, on `device`: the response's
    attention mask and last_turn_mask padded to width, the per-trajectory counters."""
    def padded(t):
        t = t.to(device, torch.float32)
        return torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], dim=1) if t.shape[1] < width else t
    return {"attention_mask": padded(out.attention_mask), "last_turn_mask": padded(out.last_turn_mask),
            **{k: getattr(out, k).to(device, torch.float32) for k in TURN_KEYS}}


def trajectory_shapes(rows: int, width: int) -> Dict[str, tuple]:
    """(shape, dtype) of each `trajectory_fields` entry, for ranks that receive them by broadcast."""
    return {"attention_mask": ((rows, width), torch.float32), "last_turn_mask": ((rows, width), torch.float32),
            **{k: ((rows,), torch.float32) for k in TURN_KEYS}}


def turn_sums(batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Per-rank sums of the turn counters ({} for a single-turn batch); the trainer sums them over DP."""
    if "num_turns" not in batch:
        return {}
    return {"trajectories": float(batch["num_turns"].numel()), **{k: batch[k].sum().item() for k in TURN_KEYS}}


def verl_num_turns(batch: Dict[str, torch.Tensor], real: torch.Tensor) -> List[int]:
    """verl's `__num_turns__` of each response, what its reward managers put in extra_info["num_turns"]: the
    prompt, the model turns and the tool-result turns (one per round of results, however many calls), so 2
    for a single-turn response. Tool rounds are read from the masks: runs of real (attention) tokens that
    are not the model's (response_mask 0), as generated."""
    rows = real.shape[0]
    if "num_turns" not in batch:
        return [2] * rows
    tool = real.bool() & ~batch["response_mask"].cpu().bool()
    starts = tool.clone()
    starts[:, 1:] &= ~tool[:, :-1]
    return (1 + batch["num_turns"].cpu().long() + starts.sum(-1)).tolist()


def turn_metrics(sums: Dict[str, float]) -> Dict[str, float]:
    """rollout/num_turns/mean, rollout/tool_calls/mean, rollout/tool_errors/mean from DP-summed counters."""
    if "trajectories" not in sums:
        return {}
    n = max(sums["trajectories"], 1.0)
    return {f"rollout/{k}/mean": sums[k] / n for k in TURN_KEYS}
