"""Chat trajectories for SFT: parquet rows of messages -> token ids and an assistant-only loss mask.

A row's `sft.messages_key` column holds [{role, content}, ...] (an assistant turn's OpenAI-style `tool_calls`
become the Hermes <tool_call> text the agent loop parses, after its content): the messages before the first
assistant turn are the prompt (rendered by the chat template, as RL prompts are), then assistant
turns and runs of other messages (tool results, user turns) alternate. Each assistant turn is its
content followed by eos (loss mask 1); each run in between is `tokenizer.continuation_text` (mask 0),
exactly the layout the agent loop builds during multi-turn rollouts, so SFT and RL see the same
tokens. `SFTLoader` yields right-padded global batches, each DP rank its own slice. Malformed
input raises one DataError naming file, row and the fix. No models, no torch.distributed.
"""
from __future__ import annotations

import json
import logging
from typing import Dict, Iterator, List, Sequence, Tuple

import torch

from hybridrl.config import SFTConfig
from hybridrl.data.prompts import DataError, read_data_table, shard_bounds
from hybridrl.tokenizer import Tokenizer

logger = logging.getLogger("hybridrl.sft")
_ROW_FIX = ("write each row's messages as [{'role': 'user', 'content': ...}, {'role': 'assistant', "
            "'content': ...}, ...] (see hybridrl.data.tool_demos.demonstration_rows)")


def read_trajectories(path: str, key: str, setting: str = "sft.train_files") -> List[object]:
    """The `key` column of one parquet file, after checking the file and the column."""
    fix = (f"fix {setting}" + (" or set sft.synthetic_task=arith (or arith_tools) to generate demonstrations "
                               "there" if setting == "sft.train_files" else ""))
    table = read_data_table(path, "SFT data file", fix, _ROW_FIX)
    if key not in table.column_names:
        raise DataError(f"SFT data file '{path}' has no column '{key}' (it has {table.column_names}); "
                        f"set sft.messages_key or {_ROW_FIX}")
    return table.column(key).to_pylist()


def _check_messages(value, where: str) -> List[Dict[str, str]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: must be a non-empty list of messages; {_ROW_FIX}")
    out = []
    for j, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if calls and content is None:  # OpenAI's form of a turn that only calls tools
            content = ""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise DataError(f"{where}: message {j} needs a string 'role' and 'content' ({m!r:.80}); {_ROW_FIX}")
        if calls:
            content += "".join(_tool_call_text(call, f"{where}: message {j}") for call in calls)
        out.append({"role": m["role"], "content": content})
    roles = [m["role"] for m in out]
    if "assistant" not in roles or roles[0] == "assistant":
        raise DataError(f"{where}: needs a prompt message and then at least one assistant message "
                        f"(roles {roles}); {_ROW_FIX}")
    return out


def _tool_call_text(call, where: str) -> str:
    """An OpenAI-style tool call ({"function": {"name", "arguments"}}, arguments a JSON string or an object) as the
    Hermes text the agent loop parses from a model turn (rollout/tools.py): trained as part of the turn, as verl's
    chat-template rendering trains it (dropping it left an empty turn to learn)."""
    from hybridrl.rollout.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

    fn = call.get("function", call) if isinstance(call, dict) else None
    name, args = (fn.get("name"), fn.get("arguments", {})) if isinstance(fn, dict) else (None, None)
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            args = None
    if not isinstance(name, str) or not isinstance(args, dict):
        raise DataError(f"{where}: tool call {call!r:.120} needs a function name and JSON-object arguments, as "
                        "{'type': 'function', 'function': {'name': ..., 'arguments': {...}}}")
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': args})}{TOOL_CALL_CLOSE}"


def tokenize_trajectory(tokenizer: Tokenizer, messages: Sequence[Dict[str, str]]) -> Tuple[List[int], List[int]]:
    """(ids, loss_mask): the prompt, then assistant turns (+ eos, mask 1) joined by the other messages."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages[:first]))
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            part, weight, i = tokenizer.encode(messages[i]["content"]) + [tokenizer.eos_token_id], 1, i + 1
        else:
            end = next((j for j in range(i, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
            if end == len(messages):
                break  # trailing messages after the last assistant turn teach nothing
            part, weight, i = tokenizer.encode(tokenizer.continuation_text(messages[i:end])), 0, end
        ids += part
        mask += [weight] * len(part)
    return ids, mask


class SFTDataset:
    """All trajectories of the given files, tokenized once; longer than sft.max_length: dropped."""

    def __init__(self, files: Sequence[str], tokenizer: Tokenizer, cfg: SFTConfig, setting: str = "sft.train_files"):
        self.files, self.tokenizer = list(files), tokenizer
        self.rows: List[Tuple[List[int], List[int]]] = []
        dropped = 0
        for path in self.files:
            for i, value in enumerate(read_trajectories(path, cfg.messages_key, setting)):
                where = f"SFT data file '{path}' row {i} column '{cfg.messages_key}'"
                ids, mask = tokenize_trajectory(tokenizer, _check_messages(value, where))
                if len(ids) > cfg.max_length:
                    dropped += 1
                    continue
                self.rows.append((ids, mask))
        if dropped:
            logger.warning("%s: dropped %d trajectories longer than sft.max_length=%d", self.files, dropped,
                           cfg.max_length)
        if not self.rows:
            raise DataError(f"no trajectories left in {self.files} (dropped {dropped} longer than "
                            f"sft.max_length={cfg.max_length}); add rows or raise sft.max_length")

    def __len__(self) -> int:
        return len(self.rows)


def right_pad(rows: Sequence[Tuple[List[int], List[int]]], pad_id: int, length: int) -> Dict[str, torch.Tensor]:
    """input_ids, attention_mask and loss_mask [B, length], padded on the right."""
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), length)
    loss = torch.zeros(len(rows), length)
    for r, (tokens, mask) in enumerate(rows):
        ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention[r, :len(tokens)] = 1.0
        loss[r, :len(tokens)] = torch.tensor(mask, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


class SFTLoader:
    """Endless global batches of `batch_size` trajectories (reshuffled per epoch, seed + epoch); each
    DP rank gets its contiguous slice, padded to the longest trajectory of the global batch."""

    def __init__(self, dataset: SFTDataset, batch_size: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int,
                 seed_drawn: bool = False):
        if batch_size % dp_size:
            raise DataError(f"sft.train_batch_size={batch_size} is not divisible by the data parallel size "
                            f"{dp_size}; make it a multiple of {dp_size}")
        if len(dataset) < batch_size:
            raise DataError(f"{dataset.files} has {len(dataset)} trajectories, fewer than one batch of "
                            f"{batch_size}; lower sft.train_batch_size or add rows")
        self.dataset, self.batch_size = dataset, batch_size
        self.dp_rank, self.dp_size, self.shuffle, self.seed = dp_rank, dp_size, shuffle, seed
        self.seed_drawn = seed_drawn
        """The seed was drawn for this run (data.seed null): a checkpoint's seed replaces it on resume."""

    def resume_seed(self, saved: int | None) -> None:
        """On resume: a drawn seed gives way to the checkpoint's (`saved`; None where the checkpoint has none), so
        the run goes on with the order it started with; a seed set otherwise than the checkpoint's is refused (the
        resumed run would read another order: batches seen twice, others skipped), as the RL loader does."""
        if saved is None:
            return
        if self.seed_drawn:
            self.seed = int(saved)
        elif int(saved) != self.seed:
            raise DataError(f"cannot resume the SFT data: the checkpoint was shuffled with seed {saved}, this run "
                            f"has data.seed={self.seed}; resume with data.seed={saved} (or null: the checkpoint's)")

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def _slice(self, rows: list) -> Dict[str, torch.Tensor]:
        """This DP rank's slice of a global batch, padded to the batch's longest trajectory."""
        start, end = shard_bounds(len(rows), self.dp_rank, self.dp_size)
        return right_pad(rows[start:end], self.dataset.tokenizer.pad_token_id, max(len(r[0]) for r in rows))

    def one_pass(self) -> Iterator[Dict[str, torch.Tensor]]:
        """Every whole batch of the data once, in file order (validation)."""
        rows = self.dataset.rows
        for k in range(len(self)):
            yield self._slice(rows[k * self.batch_size:(k + 1) * self.batch_size])

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self.batches_after(0)

    def batches_after(self, done: int) -> Iterator[Dict[str, torch.Tensor]]:
        """The batches that follow the first `done` ones (where a resumed run goes on): that epoch's order, from
        the batch after them."""
        epoch, first = divmod(done, len(self))
        while True:
            n = len(self.dataset)
            order = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
                     if self.shuffle else list(range(n)))
            for k in range(first, len(self)):
                yield self._slice([self.dataset.rows[i] for i in order[k * self.batch_size:(k + 1) * self.batch_size]])
            epoch, first = epoch + 1, 0
