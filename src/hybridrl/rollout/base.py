"""The rollout-engine protocol and the sampling rules every engine shares.

An engine turns prompts into responses plus the log-prob of each sampled token under
log_softmax(logits / T) over the full vocabulary (greedy, T = 0: log_softmax(logits)), which is what
the actor recomputes. Sampling is layout-independent: the noise that picks token t of sample j of
prompt i is a counter-based hash of (its seed from (prompt_seeds[i], j), t, token id) alone, so batch
composition, slot order, DP size and TP size never change what is sampled, and one tensor op draws
the noise of a whole batch. This module holds no model code and no torch.distributed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of tokens whose probability mass is >= top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    max_new_tokens: int = 16
    """Longest response in tokens (also the width R of the returned tensors)."""
    stop_token_ids: tuple = ()
    """Tokens that end a response (included in it); the engine's eos_id is added to these."""
    ignore_eos: bool = False
    """Nothing ends a response before max_new_tokens: stop_token_ids and the engine's eos are not read (verl's
    rollout.ignore_eos, vLLM's SamplingParams.ignore_eos)."""
    seed: int = 0
    """Default prompt seeds are seed + prompt index."""

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams needs n >= 1 and max_new_tokens >= 1, got {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams needs temperature >= 0 and 0 < top_p <= 1, got {self}")


@dataclass
class RolloutOutput:
    responses: torch.Tensor
    """LongTensor [N*n, R], right-padded with pad_id; row i*n + j is sample j of prompt i."""
    response_mask: torch.Tensor
    """float [N*n, R]: 1 on generated tokens (the stop token included), 0 on padding (and on tool
    output in a multi-turn trajectory: the loss mask)."""
    log_probs: torch.Tensor
    """float [N*n, R]: log_softmax(logits / T)[token] of each sampled token, 0 elsewhere."""
    stats: dict = field(default_factory=dict)
    """Engine counters (e.g. rollout/forward_tokens, rollout/generated_tokens)."""
    attention_mask: torch.Tensor | None = None
    """float [N*n, R]: 1 on every real token (generated and tool output), 0 on padding; None: the
    same as response_mask (single-turn engines)."""
    weight_epochs: torch.Tensor | None = None
    """long [N*n]: weight updates the engine took in during this call before the row started (partial
    rollout: the row's tokens come from that version on); None: no update during the call."""
    routed_experts: torch.Tensor | None = None
    """int16 [N*n, P + R, moe_layers, topk], only from an engine asked to record routes (MoE models): the
    global expert ids (megatron's router `top_indices`, descending score) each MoE layer chose for each
    token fed through the model. Columns line up with the trainer's input_ids = [prompts left-padded to
    P; responses]: P is the longest prompt of the call (a caller that pads wider adds columns on the
    left), prompt token j of row i is column P - len(prompt_i) + j and response token t is column P + t
    (the last generated token included). Left padding and the columns after a row's last token hold
    arange(topk). None: not recorded."""


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 prompt_seeds: list[int] | None = None) -> RolloutOutput: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], verify: str = "fingerprint") -> dict:
        """HF-named full tensors in; out {hf_name: Stored}: the slice of each that this rank stores, and
        `weight_digest(slice, verify)` read back from the engine's own parameters after the load
        ({} when verify is "off")."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


# ---- seeds and per-row randomness -----------------------------------------------------------------

def sample_seed(prompt_seed: int, sample_index: int) -> int:
    """A 63-bit seed for sample `sample_index` of a prompt (splitmix64 of the pair)."""
    x = ((prompt_seed & _MASK64) * 0x9E3779B97F4A7C15 + sample_index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def expand_requests(prompt_token_ids: list[list[int]], sampling: SamplingParams,
                    prompt_seeds: list[int] | None = None) -> list[tuple[list[int], int]]:
    """(prompt, seed) per output row, prompt-major: row i*n + j is sample j of prompt i."""
    if prompt_seeds is None:
        prompt_seeds = [sampling.seed + i for i in range(len(prompt_token_ids))]
    if len(prompt_seeds) != len(prompt_token_ids):
        raise ValueError(f"{len(prompt_seeds)} prompt_seeds for {len(prompt_token_ids)} prompts")
    for i, p in enumerate(prompt_token_ids):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    return [(list(p), sample_seed(s, j)) for p, s in zip(prompt_token_ids, prompt_seeds)
            for j in range(sampling.n)]


_M32, _GOLDEN = 0xFFFFFFFF, 0x9E3779B9


def _pcg_hash(x: torch.Tensor) -> torch.Tensor:
    """PCG output hash of 32-bit words held in int64 (Jarzynski & Olano 2020): every product stays
    below 2^63, so CPU and CUDA agree bit for bit and no signed overflow occurs."""
    state = (x * 747796405 + 2891336453) & _M32
    word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737 & _M32
    return (word >> 22) ^ word


def row_keys(seeds: list[int], device) -> torch.Tensor:
    """[B] int64 32-bit noise key per row from its 63-bit sample seed (both words hashed)."""
    s = torch.tensor(seeds, dtype=torch.int64, device=device)
    return _pcg_hash(_pcg_hash(s & _M32) ^ (s >> 32))


@functools.lru_cache(maxsize=8)
def _token_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """[V] hashed token ids (made once per vocabulary and device; never changed)."""
    return _pcg_hash(torch.arange(vocab, device=device, dtype=torch.int64) + _GOLDEN)


def gumbel_noise(keys: torch.Tensor, token_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] Gumbel(0, 1); entry (b, v) depends on (keys[b], token_index[b], v) only.

    Rows are keyed by their own token counter, never by the batch step, so a request draws the same
    noise whatever slot it sits in and whenever it was admitted.
    """
    step_key = _pcg_hash((keys + token_index * _GOLDEN) & _M32)  # a Weyl sequence per request, hashed
    bits = _pcg_hash(step_key[:, None] ^ _token_keys(vocab, keys.device)[None, :]) >> 8  # 24 bits: exact in fp32
    u = (bits.float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


# ---- filtering and sampling -----------------------------------------------------------------------

def filter_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits/T [B, V] with everything outside top-k, then outside the top-p nucleus, set to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True, stable=True)
        # a token stays when the mass strictly before it is < top_p: the smallest set reaching top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(logits: torch.Tensor, sampling: SamplingParams, keys: torch.Tensor, token_index: torch.Tensor):
    """(tokens [B], log_probs [B]) from logits [B, V] over the true vocabulary.

    keys [B] (`row_keys`) and token_index [B] (tokens each row has generated so far) drive the noise;
    greedy ignores them. Log-probs are of the temperature-scaled distribution over the full vocabulary;
    top-k / top-p only restrict which token is drawn (verl's convention).
    """
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / sampling.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        filtered = filter_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
        # Gumbel-max: argmax(x + G) is an exact sample of softmax(x)
        tokens = (filtered + gumbel_noise(keys, token_index, logits.shape[-1])).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def left_align_routes(by_position: torch.Tensor, prompt_lens: list[int], new: int) -> torch.Tensor:
    """Routes stored per sequence position ([rows, >= P + new, ...]; prompt token j at j, response token t
    at len(prompt) + t) -> `RolloutOutput.routed_experts`' columns [rows, P + new, ...], P = max(prompt_lens)."""
    rows, width = len(prompt_lens), max(prompt_lens, default=0) + new
    shift = width - new - torch.tensor(prompt_lens, dtype=torch.long, device=by_position.device)  # left pads
    source = torch.arange(width, device=by_position.device)[None] - shift[:, None]
    index = source.clamp(min=0).view(rows, width, *[1] * (by_position.dim() - 2)).expand(
        rows, width, *by_position.shape[2:])
    out = by_position.gather(1, index)
    blank = torch.arange(by_position.shape[-1], dtype=by_position.dtype, device=by_position.device)
    return torch.where((source < 0).view(rows, width, *[1] * (by_position.dim() - 2)), blank, out)


def pack_output(tokens: list[list[int]], log_probs: list[list[float]], width: int, pad_id: int,
                stats: dict | None = None) -> RolloutOutput:
    """Right-pad per-row token / log-prob lists into the tensors of a RolloutOutput."""
    rows = len(tokens)
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, width)
    logp = torch.zeros(rows, width)
    for r, (toks, lps) in enumerate(zip(tokens, log_probs)):
        responses[r, :len(toks)] = torch.tensor(toks, dtype=torch.long)
        mask[r, :len(toks)] = 1.0
        logp[r, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return RolloutOutput(responses, mask, logp, dict(stats or {}))
