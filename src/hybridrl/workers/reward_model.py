"""The reward model: a frozen GPT trunk with a scalar head that scores whole prompt + response sequences.

Scored token: transformers' `*ForSequenceClassification` pools the rightmost token whose id is not
`config.pad_token_id` (so left and right padding both work, and a response ending in a token equal
to the pad id is scored one token earlier). `score_positions` picks that token among the ones the
attention mask marks real: transformers' choice whenever padding carries the pad id, and the last
real token when the config has no pad id. The trunk runs through `ModelEngine`, i.e. megatron's
pipeline schedule, at the training TP/PP.

Inputs: with the actor's tokenizer the batch's token ids are scored as they are. A reward model
with its own tokenizer gets the conversation re-rendered, as verl does: the prompt's chat messages
plus the decoded response as an assistant turn, through the RM tokenizer's chat template, encoded,
kept to `max_length` tokens from the end (where the score is read).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from hybridrl.config import ConfigError
from hybridrl.data.prompts import left_pad
from hybridrl.workers.critic import value_tokens
from hybridrl.workers.engine import ModelEngine, split_micro_batches


def score_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    pad_token_id: Optional[int]) -> torch.Tensor:
    """[B] index of the token each row is scored at (see module doc); 0 for a row without one."""
    real = attention_mask.bool()
    if pad_token_id is not None:
        real = real & (input_ids != pad_token_id)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * real).argmax(-1)


class ChatReencoder:
    """Prompt messages + decoded responses -> the reward model tokenizer's ids (left-padded)."""

    def __init__(self, tokenizer, max_length: int, pad_token_id: int):
        self.tokenizer, self.max_length, self.pad_token_id = tokenizer, max_length, pad_token_id

    def text(self, messages: Sequence[Dict[str, str]], response: str) -> str:
        conversation = list(messages) + [{"role": "assistant", "content": response}]
        return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=False)

    def encode(self, messages: Sequence[Dict[str, str]], response: str) -> List[int]:
        return self.tokenizer.encode(self.text(messages, response))[-self.max_length:]

    def __call__(self, messages: Sequence[Sequence[Dict[str, str]]], responses: Sequence[str], device):
        input_ids, mask = left_pad([self.encode(m, r) for m, r in zip(messages, responses)], self.pad_token_id)
        return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def build_reencoder(cfg, pad_token_id: Optional[int]) -> Optional[ChatReencoder]:
    """The re-encoder for reward_model.tokenizer; None when the reward model reads the actor's ids
    (reward_model.tokenizer empty or the one the run's data.tokenizer resolves to). Pads with the RM's pad_token_id."""
    from hybridrl.tokenizer import TokenizerError, load_tokenizer, tokenizer_source

    rm = cfg.reward_model
    if rm.tokenizer in ("", tokenizer_source(cfg.data.tokenizer, cfg.model.path)):
        return None
    try:
        tokenizer = load_tokenizer(rm.tokenizer)
    except TokenizerError as err:
        raise TokenizerError(f"reward_model.tokenizer: {err}") from None
    max_length = rm.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
    return ChatReencoder(tokenizer, max_length, tokenizer.pad_token_id if pad_token_id is None else pad_token_id)


def check_vocab(tokenizer, model_vocab_size: int) -> None:
    """A reward model must embed every id its tokenizer produces."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"the reward model's vocabulary ({model_vocab_size} tokens) is smaller than the "
                          f"tokenizer's ({tokenizer.vocab_size}, {tokenizer.name}); set "
                          "reward_model.tokenizer to the reward model's own tokenizer")


class RewardModelWorker:
    """`compute_rm_score(batch, messages, responses) -> [B]` fp32 scores, on every rank of the replica."""

    def __init__(self, engine: ModelEngine, pad_token_id: Optional[int], micro_batch_size: int,
                 reencoder: Optional[ChatReencoder] = None):
        self.engine, self.pad_token_id, self.micro_batch_size = engine, pad_token_id, micro_batch_size
        self.reencoder = reencoder
        self.offloader = None
        """Set when reward_model.offload_params keeps the weights on the host between uses."""

    def model_inputs(self, batch: Dict[str, torch.Tensor], messages: List, responses: List[str]):
        """input_ids / attention_mask in the reward model's vocabulary."""
        if self.reencoder is None:
            return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return self.reencoder(messages, responses, batch["input_ids"].device)

    @torch.no_grad()
    def compute_rm_score(self, batch: Dict[str, torch.Tensor], messages: List, responses: List[str]) -> torch.Tensor:
        """Scores of the rows of `batch`; messages/responses (one per row) are read only when re-encoding."""
        self.engine.train(False)
        inputs = self.model_inputs(batch, messages, responses)
        inputs["score_index"] = score_positions(inputs["input_ids"], inputs["attention_mask"], self.pad_token_id)

        def loss_fn(values, mb):
            rows = torch.arange(values.shape[0], device=values.device)
            return values.new_zeros(()), {"scores": values[rows, mb["score_index"]].float()}

        parts = self.engine.run(split_micro_batches(inputs, self.micro_batch_size),
                                lambda tokens, mb: loss_fn(tokens["values"], mb), True, value_tokens)
        return torch.cat([p["scores"] for p in parts])
