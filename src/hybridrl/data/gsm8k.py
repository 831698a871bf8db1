"""Convert local GSM8k files (jsonl, json or parquet with `question`, `answer`) to the prompt layout.

Same rows as verl's examples/data_preprocess/gsm8k.py: data_source "openai/gsm8k", one user
message = question + the "####" instruction, ground truth = the text after "####" without commas.
Local paths only; this module never downloads.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Dict, List, Sequence

from hybridrl.data.prompts import DataError, json_records, read_data_table, write_prompt_parquet

GSM8K_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
SPLITS = ("train", "test")
_EXTENSIONS = (".jsonl", ".json", ".parquet")


def extract_gsm8k_answer(answer: str) -> str:
    """'... #### 1,234' -> '1234'."""
    if "####" not in answer:
        raise ValueError(f"GSM8k answer has no '####': {answer[-80:]!r}")
    return answer.split("####")[-1].replace(",", "").strip()


def gsm8k_row(question: str, answer: str, split: str, index: int) -> Dict[str, Any]:
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_gsm8k_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_gsm8k_records(path: str) -> List[Dict[str, Any]]:
    """(question, answer) records of one jsonl, json or parquet file, checked."""
    if path.endswith(".parquet"):
        records = read_data_table(path, "GSM8k file", "pass local train/test files or their folder",
                                     "GSM8k parquet has string columns 'question' and 'answer'").to_pylist()
    else:
        records = json_records(path, "GSM8k file")
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise DataError(f"'{path}' row {i} is a {type(r).__name__}, not an object; GSM8k rows are "
                            "{\"question\": ..., \"answer\": ...} objects (one per jsonl line, or a .json array)")
        for key in ("question", "answer"):
            if not isinstance(r.get(key), str):
                raise DataError(f"'{path}' row {i} has no string '{key}'; GSM8k rows need "
                                "'question' and 'answer'")
        if "####" not in r["answer"]:
            raise DataError(f"'{path}' row {i} column 'answer' has no '#### <number>' final answer")
    return records


def _split_of(path: str) -> str:
    name = os.path.basename(path).lower()
    for split in SPLITS:
        if name.startswith(split):
            return split
    raise DataError(f"cannot tell the split of '{path}'; name GSM8k files train*.jsonl/parquet and "
                    "test*.jsonl/parquet")


def find_gsm8k_files(inputs: Sequence[str]) -> Dict[str, str]:
    """{split: file} from files and/or folders (searched recursively for train*/test* files)."""
    found: Dict[str, List[str]] = {s: [] for s in SPLITS}
    for item in inputs:
        if os.path.isdir(item):
            for path in sorted(glob.glob(os.path.join(item, "**", "*"), recursive=True)):
                name = os.path.basename(path).lower()
                if path.endswith(_EXTENSIONS) and name.startswith(SPLITS):
                    found[_split_of(path)].append(path)
        elif os.path.isfile(item):
            found[_split_of(item)].append(item)
        else:
            raise DataError(f"GSM8k input '{item}' does not exist; pass local train/test files or "
                            "their folder (no downloads)")
    for split, paths in found.items():
        if len(paths) != 1:
            raise DataError(f"expected one GSM8k {split} file in {list(inputs)}, found {paths or 'none'};"
                            " pass the files themselves or one subset folder (e.g. .../main)")
    return {split: paths[0] for split, paths in found.items()}


def prepare_gsm8k(inputs: Sequence[str] | str, output_dir: str) -> Dict[str, str]:
    """Convert GSM8k train/test files to output_dir/{train,test}.parquet; returns the paths. Both inputs are
    read and checked before either output is written (each atomically), so bad input leaves old outputs whole."""
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    rows = {split: [gsm8k_row(r["question"], r["answer"], split, i) for i, r in enumerate(read_gsm8k_records(path))]
            for split, path in find_gsm8k_files(inputs).items()}
    return {split: write_prompt_parquet(split_rows, os.path.join(output_dir, f"{split}.parquet"))
            for split, split_rows in rows.items()}
