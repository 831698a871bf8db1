"""Tests of scripts/prepare_gsm8k.py and hybridrl.data.gsm8k on small GSM8k-format files."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrl.config import DataConfig
from hybridrl.data.prompts import DataError, PromptDataset
from hybridrl.data.gsm8k import INSTRUCTION, prepare_gsm8k
from hybridrl.rewards import gsm8k
from hybridrl.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
                 "babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
               "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "A farm has 40 rows of 40 trees. How many trees are there?",
     "answer": "There are 40*40 = <<40*40=1600>>1,600 trees.\n#### 1,600"},
]
TEST = [
    {"question": "The temperature was 4 degrees and fell by 7 degrees. What is it now?",
     "answer": "It is 4-7 = <<4-7=-3>>-3 degrees.\n#### -3"},
    {"question": "Betty has half of the $100 she needs. Her parents give her $15 and her "
                 "grandparents twice as much. How much more does she need?",
     "answer": "She has 100/2 = $<<100/2=50>>50. Grandparents give 15*2 = $<<15*2=30>>30. She "
               "needs 100-50-30-15 = $<<100-50-30-15=5>>5 more.\n#### 5"},
]


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_script_converts_jsonl_folder(tmp_path):
    src = tmp_path / "gsm8k" / "main"
    write_jsonl(src / "train.jsonl", TRAIN)
    write_jsonl(src / "test.jsonl", TEST)
    out = tmp_path / "out"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_gsm8k.py"),
                    "--input", str(src), "--output_dir", str(out)], check=True,
                   capture_output=True, text=True)
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "10", "1600"]
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"] == [{"role": "user", "content": TRAIN[0]["question"] + " " + INSTRUCTION}]
    assert first["reward_model"]["style"] == "rule"
    assert first["extra_info"] == {"split": "train", "index": 0, "answer": TRAIN[0]["answer"],
                                   "question": TRAIN[0]["question"]}

    tok = load_tokenizer("builtin:tiny")
    for split, records in (("train", TRAIN), ("test", TEST)):
        ds = PromptDataset([str(out / f"{split}.parquet")], tok, DataConfig(max_prompt_length=512))
        assert len(ds) == len(records)
        for r, ref in zip(ds.rows, records):  # the reference solution scores full marks
            assert gsm8k.compute_score(ref["answer"], r.ground_truth) == 1.0
            assert r.extra_info["split"] == split


def test_parquet_inputs_as_files(tmp_path):
    train = tmp_path / "train-00000-of-00001.parquet"
    test = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(TRAIN), str(train))
    pq.write_table(pa.Table.from_pylist(TEST), str(test))
    paths = prepare_gsm8k([str(train), str(test)], str(tmp_path / "out"))
    rows = pq.read_table(paths["test"]).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["-3", "5"]


def test_input_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_gsm8k(str(tmp_path / "missing"), str(tmp_path / "out"))
    only_train = tmp_path / "only"
    write_jsonl(only_train / "train.jsonl", TRAIN)
    with pytest.raises(DataError, match="one GSM8k test file"):
        prepare_gsm8k(str(only_train), str(tmp_path / "out"))
    two = tmp_path / "two"
    for sub in ("main", "socratic"):
        write_jsonl(two / sub / "train.jsonl", TRAIN)
        write_jsonl(two / sub / "test.jsonl", TEST)
    with pytest.raises(DataError, match="subset folder"):
        prepare_gsm8k(str(two), str(tmp_path / "out"))
    bad = tmp_path / "bad"
    write_jsonl(bad / "train.jsonl", [{"question": "q", "answer": "no final answer"}])
    write_jsonl(bad / "test.jsonl", TEST)
    with pytest.raises(DataError, match="row 0 column 'answer'"):
        prepare_gsm8k(str(bad), str(tmp_path / "out"))
    odd = write_jsonl(tmp_path / "odd" / "dev.jsonl", TEST)
    with pytest.raises(DataError, match="cannot tell the split"):
        prepare_gsm8k([odd], str(tmp_path / "out"))


def test_json_array_files_convert(tmp_path):
    src = tmp_path / "arrays"
    src.mkdir()
    (src / "train.json").write_text(json.dumps(TRAIN, indent=2))
    (src / "test.json").write_text(json.dumps(TEST))
    paths = prepare_gsm8k(str(src), str(tmp_path / "out"))
    assert [r["reward_model"]["ground_truth"] for r in pq.read_table(paths["train"]).to_pylist()] == ["72", "10", "1600"]
    assert [r["extra_info"]["question"] for r in pq.read_table(paths["test"]).to_pylist()] == [r["question"] for r in TEST]


def test_bad_inputs_are_data_errors_and_leave_earlier_outputs_whole(tmp_path):
    out = tmp_path / "out"
    good = tmp_path / "good"
    write_jsonl(good / "train.jsonl", TRAIN)
    write_jsonl(good / "test.jsonl", TEST)
    prepare_gsm8k(str(good), str(out))
    before = {split: (out / f"{split}.parquet").read_bytes() for split in ("train", "test")}

    not_object = tmp_path / "not_object"
    write_jsonl(not_object / "train.jsonl", TRAIN[:2])  # a good train file, other rows than the outputs'
    write_jsonl(not_object / "test.jsonl", TEST[:1] + [["a question", "#### 1"]])
    with pytest.raises(DataError, match=r"test.jsonl' row 1 is a list, not an object"):
        prepare_gsm8k(str(not_object), str(out))

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    pq.write_table(pa.Table.from_pylist(TRAIN[1:]), str(corrupt / "train.parquet"))
    (corrupt / "test.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"GSM8k file '.*test.parquet' is not a parquet file"):
        prepare_gsm8k(str(corrupt), str(out))

    assert {split: (out / f"{split}.parquet").read_bytes() for split in ("train", "test")} == before
    assert sorted(os.listdir(out)) == ["test.parquet", "train.parquet"]  # no temporary files left
