"""Prompt data: parquet files in verl's layout -> tokenized, left-padded, DP-sharded batches.

A row holds `data_source` (str), the prompt column (`data.prompt_key`: chat messages
[{role, content}] or a plain string, which becomes one user message), `ability`,
`reward_model` {style, ground_truth} and `extra_info` (dict). `PromptDataset` validates and
tokenizes every row once (chat template, then `max_prompt_length` filtering or truncation);
`PromptLoader` shuffles per epoch (verl's order: one generator seeded once), gives each DP rank a disjoint equal slice of
every global batch, and can resume mid-epoch from `state_dict()`. Malformed input raises one
`DataError` naming file, row and column and the fix. This module knows nothing about models,
rewards or torch.distributed: the caller passes dp_rank/dp_size.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from hybridrl.config import DataConfig
from hybridrl.tokenizer import ChatTemplateError, Tokenizer

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")
_LAYOUT_FIX = ("write rows as {data_source, prompt: [{role, content}], ability, "
               "reward_model: {style, ground_truth}, extra_info} (see scripts/prepare_gsm8k.py)")


class DataError(ValueError):
    """Malformed prompt data; the message names file, row and column and the fix."""


@dataclass(frozen=True)
class PromptRow:
    """One tokenized prompt; `index` is its row over the dataset's files in order (a second file's first row
    follows the first file's last, filtered rows counted): sampling seeds derive from it, so rows of two files
    never share one."""
    input_ids: List[int]
    raw_prompt: str
    data_source: str
    ground_truth: Any
    extra_info: Dict[str, Any]
    file: str
    index: int
    messages: List[Dict[str, str]] = field(default_factory=list)
    """The chat messages before templating (a reward model with its own template re-renders them)."""


@dataclass
class PromptBatch:
    """Prompts of one DP rank: tensors [B, P] left-padded, the rest as python lists."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    data_source: List[str]
    ground_truth: List[Any]
    extra_info: List[Dict[str, Any]]
    raw_prompt: List[str]
    index: List[int]
    messages: List[List[Dict[str, str]]] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int,
             length: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, length] with the pads on the left; length = longest if None."""
    length = max((len(s) for s in seqs), default=0) if length is None else length
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than length={length}")
        if len(s):
            ids[i, length - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, length - len(s):] = 1
    return ids, mask


def collate(rows: Sequence[PromptRow], pad_id: int, length: Optional[int] = None) -> PromptBatch:
    ids, mask = left_pad([r.input_ids for r in rows], pad_id, length)
    return PromptBatch(ids, mask, [r.data_source for r in rows], [r.ground_truth for r in rows],
                       [r.extra_info for r in rows], [r.raw_prompt for r in rows],
                       [r.index for r in rows], [r.messages for r in rows])


def read_data_table(path: str, what: str, missing_fix: str, layout_fix: str):
    """One data file as a pyarrow Table ('~' expanded): parquet, or as verl also reads, JSON (`.json`: an array of
    records, or one record per line; `.jsonl`: one per line). A missing or unreadable file is one DataError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"{what} '{path}' does not exist; {missing_fix}")
    if path.endswith((".json", ".jsonl")):
        records = json_records(path, what)
        bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(f"{what} '{path}' row {bad} is a {type(records[bad]).__name__}, not an object of named "
                            f"fields; {layout_fix}")
        columns = dict.fromkeys(key for record in records for key in record)  # every record's, in first-seen order
        try:
            return pa.Table.from_pydict({key: [record.get(key) for record in records] for key in columns})
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise DataError(f"{what} '{path}': its records do not share one layout ({e}); give every record the "
                            f"same keys with values of the same type, and {layout_fix}") from e
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{what} '{path}' is not a parquet file ({e}); convert it to parquet, "
                        f"e.g. pyarrow.parquet.write_table, or to JSON lines (.jsonl), and {layout_fix}") from e


def json_records(path: str, what: str) -> List[Any]:
    """The records of a .jsonl file (one per line) or a .json file (an array, or one record per line); a
    malformed one is one DataError naming the line."""
    import json

    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{what} '{path}' is not valid JSON (line {e.lineno}: {e.msg}); fix it, or write one "
                            "record per line") from e
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{what} '{path}' line {n} is not a JSON record ({e.msg}); write one JSON object "
                                "per line") from e
    return records


def read_parquet_records(path: str, prompt_key: str) -> List[Dict[str, Any]]:
    """Rows of one parquet file as dicts, after checking the file and its columns."""
    table = read_data_table(path, "data file", "fix data.train_files/data.val_files, or create it "
                               "(scripts/prepare_gsm8k.py for GSM8K), or set data.synthetic_task=arith to generate "
                               "the synthetic demo task there", _LAYOUT_FIX)
    for column in (prompt_key,) + REQUIRED_COLUMNS:
        if column not in table.column_names:
            hint = " (or set data.prompt_key)" if column == prompt_key else ""
            raise DataError(f"data file '{path}' has no column '{column}'{hint}; it has "
                            f"{table.column_names}; {_LAYOUT_FIX}")
    return table.to_pylist()


def _messages(value: Any, where: str) -> List[Dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: must be a plain string or a non-empty list of "
                        f"{{role, content}} messages, got {type(value).__name__} {value!r:.80}")
    for j, m in enumerate(value):
        for key in ("role", "content"):
            if not isinstance(m, dict) or not isinstance(m.get(key), str):
                raise DataError(f"{where}: message {j} has no string '{key}' ({m!r:.80}); each "
                                "message must be {'role': 'user', 'content': '...'}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def parse_record(record: Dict[str, Any], path: str, row: int, prompt_key: str):
    """(messages, data_source, ground_truth, extra_info) of one row, or a DataError naming it."""
    where = f"data file '{path}' row {row} column '{{}}'"
    messages = _messages(record[prompt_key], where.format(prompt_key))
    data_source = record["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise DataError(f"{where.format('data_source')}: must be a non-empty string (it picks the "
                        f"reward function), got {data_source!r:.80}")
    reward_model = record["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{where.format('reward_model')}: needs a 'ground_truth', got "
                        f"{reward_model!r:.80}; write reward_model={{'style': 'rule', "
                        "'ground_truth': '...'}")
    extra_info = record.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where.format('extra_info')}: must be a dict (or missing), got "
                        f"{type(extra_info).__name__}")
    ground_truth = _ground_truth(reward_model["ground_truth"], where.format("reward_model"))
    return messages, data_source, ground_truth, extra_info


def _ground_truth(value: Any, where: str) -> Any:
    """A float column's answer as the text a scorer compares with: 72.0 -> '72'; NaN or inf is an error."""
    if not isinstance(value, float):
        return value
    if not math.isfinite(value):
        raise DataError(f"{where}: ground_truth is {value}, which no response can match; write the answer "
                        "(e.g. '72') or drop the row")
    return str(int(value)) if value.is_integer() else value


def _fit_length(ids: List[int], cfg: DataConfig, where: str) -> Optional[List[int]]:
    """The ids within max_prompt_length, or None when the prompt is filtered out."""
    limit = cfg.max_prompt_length
    if len(ids) <= limit:
        return ids
    if cfg.filter_overlong_prompts:
        return None
    if cfg.truncation == "left":
        return ids[-limit:]
    if cfg.truncation == "right":
        return ids[:limit]
    raise DataError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={limit}; raise "
                    "data.max_prompt_length, set data.filter_overlong_prompts=true, or set "
                    "data.truncation=left/right")


class PromptDataset:
    """All rows of the given parquet files, validated and tokenized once."""

    def __init__(self, files: Sequence[str] | str, tokenizer: Tokenizer, cfg: DataConfig):
        self.files = [files] if isinstance(files, str) else list(files)
        self.tokenizer, self.cfg = tokenizer, cfg
        self.rows: List[PromptRow] = []
        self.num_filtered, self.num_read = 0, 0
        for path in self.files:
            self._add_file(path)
        if self.num_filtered:
            logger.warning("%s: filtered %d of %d prompts longer than data.max_prompt_length=%d",
                           self.files, self.num_filtered, self.num_filtered + len(self.rows),
                           cfg.max_prompt_length)
        if not self.rows:
            raise DataError(f"no prompts left in {self.files} (filtered {self.num_filtered} longer "
                            f"than data.max_prompt_length={cfg.max_prompt_length}); add rows or "
                            "raise data.max_prompt_length")

    def _add_file(self, path: str) -> None:
        records = read_parquet_records(path, self.cfg.prompt_key)
        first, self.num_read = self.num_read, self.num_read + len(records)
        for i, record in enumerate(records):
            messages, data_source, ground_truth, extra_info = parse_record(
                record, path, i, self.cfg.prompt_key)
            where = f"data file '{path}' row {i} column '{self.cfg.prompt_key}'"
            try:
                text = self.tokenizer.apply_chat_template(messages)
            except ChatTemplateError as e:
                raise DataError(f"{where}: {e}; fix the row's messages or pick a tokenizer whose template "
                                "accepts them (data.tokenizer)") from e
            ids = _fit_length(self.tokenizer.encode(text), self.cfg, where)
            if ids is None:
                self.num_filtered += 1
                continue
            self.rows.append(PromptRow(ids, text, data_source, ground_truth, extra_info, path, first + i, messages))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]


def shard_bounds(n: int, dp_rank: int, dp_size: int) -> Tuple[int, int]:
    """[start, end) of rank dp_rank's contiguous slice of n items (sizes differ by at most one)."""
    base, extra = divmod(n, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return start, start + base + (1 if dp_rank < extra else 0)


class PromptLoader:
    """Global batches of `batch_size` prompts, each DP rank yielding its own slice.

    Every rank computes the same per-epoch order, so slices are disjoint without communication: epoch e's is the
    first of the two permutations torch's RandomSampler draws per epoch from one generator seeded once with
    `seed` (verl's training sampler), so a run here sees verl's prompt order. All ranks pad to the longest prompt of the global batch, so shapes do not
    depend on dp_size. Iterating yields the rest of the current epoch, then moves to the next.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 shuffle: bool = True, seed: int = 1, drop_last: bool = True, seed_drawn: bool = False):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if drop_last and batch_size % dp_size:
            raise DataError(f"batch size {batch_size} is not divisible by the data parallel size "
                            f"{dp_size}; make data.train_batch_size a multiple of {dp_size}")
        if drop_last and len(dataset) < batch_size:
            raise DataError(f"{dataset.files} has {len(dataset)} prompts, fewer than one batch of "
                            f"{batch_size}; lower data.train_batch_size or add prompts")
        self.dataset, self.batch_size = dataset, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.seed_drawn = seed_drawn
        """The seed was drawn for this run (data.seed null): a checkpoint's seed replaces it on resume."""
        self.epoch, self.batch_index = 0, 0
        self._orders = (0, None, None)  # (epoch, its order, the generator's state after drawing it)

    def __len__(self) -> int:
        """Global batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> List[int]:
        """Dataset positions in epoch `epoch`'s order (the draws of the epochs before it replayed once)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        at, order, state = self._orders
        g = torch.Generator()
        if order is not None and at <= epoch:
            g.set_state(state)
        else:
            at, order = -1, None
            g.manual_seed(self.seed)
        while at < epoch:  # RandomSampler draws a second permutation per epoch for its (empty) remainder
            order, at = torch.randperm(len(self.dataset), generator=g).tolist(), at + 1
            torch.randperm(len(self.dataset), generator=g)
        self._orders = (at, order, g.get_state())
        return list(order)

    def global_batch(self, epoch: int, batch_index: int) -> List[int]:
        """Dataset positions of one global batch (all DP ranks together)."""
        b = self.batch_size
        return self.epoch_order(epoch)[batch_index * b:(batch_index + 1) * b]

    def __iter__(self) -> Iterator[PromptBatch]:
        epoch, order = self.epoch, self.epoch_order(self.epoch)
        pad_id, b = self.dataset.tokenizer.pad_token_id, self.batch_size
        for k in range(self.batch_index, len(self)):
            positions = order[k * b:(k + 1) * b]
            rows = [self.dataset[i] for i in positions]
            start, end = shard_bounds(len(rows), self.dp_rank, self.dp_size)
            length = max(len(r.input_ids) for r in rows)
            # Advance before yielding: a state_dict taken after this batch resumes at the next one.
            self.epoch, self.batch_index = (epoch + 1, 0) if k + 1 == len(self) else (epoch, k + 1)
            yield collate(rows[start:end], pad_id, length)

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                "batch_size": self.batch_size, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if self.seed_drawn and state.get("seed") is not None:  # data.seed null: the order the run started with
            self.seed, self._orders = int(state["seed"]), (0, None, None)
        for key, mine in (("batch_size", self.batch_size), ("num_prompts", len(self.dataset)),
                          ("seed", self.seed)):
            if key in state and int(state[key]) != mine:
                raise DataError(f"cannot resume the data loader: checkpoint has {key}={state[key]}, "
                                f"this run has {mine}; resume with the same data and data.* settings")
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        if self.batch_index >= len(self):  # saved after an epoch's last batch
            self.epoch, self.batch_index = self.epoch + 1, 0


def make_train_loader(cfg: DataConfig, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1,
                      drawn_seed: int | None = None) -> PromptLoader:
    """The training prompts' loader; with data.seed null, `drawn_seed` (the same on every rank) seeds it."""
    if cfg.seed is None and drawn_seed is None:
        raise ValueError("data.seed is null: pass the run's drawn seed (parallel.distributed.agreed_random_seed)")
    dataset = PromptDataset(cfg.train_files, tokenizer, cfg)
    seed = drawn_seed if cfg.seed is None else cfg.seed
    return PromptLoader(dataset, cfg.train_batch_size, dp_rank, dp_size, cfg.shuffle, seed, True, cfg.seed is None)


def make_val_loader(cfg: DataConfig, tokenizer: Tokenizer, dp_rank: int = 0,
                    dp_size: int = 1) -> PromptLoader:
    """Every validation prompt once, in file order; the last batch may be short (or empty on a rank)."""
    dataset = PromptDataset(cfg.val_files, tokenizer, cfg)
    batch = cfg.val_batch_size or max(1, len(dataset))  # null: the whole set, as verl
    return PromptLoader(dataset, batch, dp_rank, dp_size, False, 0, False)  # file order: no seed


def write_prompt_parquet(rows: Sequence[Dict[str, Any]], path: str) -> str:
    """Write rows in the layout above; atomic (tmp file + rename) so concurrent writers are safe."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    os.replace(tmp, path)
    return path
