"""Preference pairs for reward-model training, generated from prompts whose answer a rule scores.

For each pair a prompt is drawn and two candidate responses are made from its ground truth: the
right number or a wrong one, possibly followed by junk (tokens drawn from the whole vocabulary, so
nothing a policy can emit is unseen), or junk alone, or nothing; each either
stops with eos or runs to `max_response_length` tokens without one, as a rollout does. Half the
pairs are contrastive: the right and a wrong number with the same continuation, which only the
sum tells apart (without them a reward model learns the format and never the addition). The data source's rule
scorer (`rewards.get_reward_fn`, on the decoded text, as PPO scores, without the near-miss shaping:
ranking two wrong sums by their distance to the right one would ask the reward model to compute
that distance) orders them: chosen is the higher score; candidates with equal scores are redrawn. The response ids are in the actor's
tokenizer, so the reward model later sees exactly what PPO feeds it. Candidates are built from a
numeric ground truth, so this serves tasks such as synthetic/arith; no model is involved.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Sequence

from hybridrl.rewards import get_reward_fn

@dataclass(frozen=True)
class PreferencePair:
    prompt: int
    """Index of the prompt row the pair answers."""
    chosen_ids: List[int]
    rejected_ids: List[int]
    chosen_score: float
    rejected_score: float


def _junk(rng: random.Random, tokenizer, k: int) -> List[int]:
    """k tokens drawn from the whole vocabulary except eos and pad: whatever a policy may emit."""
    banned = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    out = []
    while len(out) < k:
        t = rng.randrange(tokenizer.vocab_size)
        if t not in banned:
            out.append(t)
    return out


def _response_ids(head: List[int], stops: bool, tokenizer, max_tokens: int, rng: random.Random) -> List[int]:
    """Stopped (head + eos) or cut at max_tokens without eos, filled with junk as a rollout would be."""
    if stops:
        return head[:max_tokens - 1] + [tokenizer.eos_token_id]
    return (head + _junk(rng, tokenizer, max_tokens))[:max_tokens]


def candidate_response(rng: random.Random, truth: str, tokenizer, max_tokens: int) -> List[int]:
    """Nothing, junk, or a number (right or wrong) maybe followed by junk; stopped or cut."""
    kind = rng.random()
    if kind < 0.05:
        head = []  # an immediate eos: a policy finds such holes in a reward model
    elif kind < 0.3:
        head = _junk(rng, tokenizer, rng.randint(1, max_tokens))
    else:
        number = truth if rng.random() < 0.5 else str(rng.randint(0, 18))
        head = tokenizer.encode(number) + (_junk(rng, tokenizer, rng.randint(1, 6)) if rng.random() < 0.3 else [])
    return _response_ids(head, rng.random() < 0.6, tokenizer, max_tokens, rng)


def contrastive_responses(rng: random.Random, truth: str, tokenizer, max_tokens: int):
    """The right number and a wrong one with the same continuation: pairs only the sum decides."""
    wrong = rng.choice([str(x) for x in range(19) if str(x) != truth])
    suffix = _junk(rng, tokenizer, rng.randint(1, 6)) if rng.random() < 0.3 else []
    stops, seed = rng.random() < 0.7, rng.random()
    return [_response_ids(tokenizer.encode(number) + suffix, stops, tokenizer, max_tokens, random.Random(seed))
            for number in (truth, wrong)]


def make_pairs(rows: Sequence, tokenizer, n: int, max_response_tokens: int, seed: int,
               contrastive: float = 0.8, max_tries: int = 50) -> List[PreferencePair]:
    """`n` pairs over the prompt rows (`data.PromptRow`), ordered by each row's rule scorer; a
    `contrastive` share differ only in the number (right or wrong), the rest are free candidates."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < n:
        i = rng.randrange(len(rows))
        row = rows[i]
        score = get_reward_fn(row.data_source, shaped=False)
        truth = str(row.ground_truth)
        pick = contrastive_responses if rng.random() < contrastive else (
            lambda *args: [candidate_response(*args) for _ in range(2)])
        for _ in range(max_tries):
            a, b = pick(rng, truth, tokenizer, max_response_tokens)
            sa, sb = (score(tokenizer.decode(ids), row.ground_truth) for ids in (a, b))
            if sa != sb:
                (c, sc), (r, sr) = sorted(((a, sa), (b, sb)), key=lambda x: -x[1])
                pairs.append(PreferencePair(i, c, r, sc, sr))
                break
    return pairs
