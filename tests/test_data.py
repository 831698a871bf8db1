"""Tests of hybridrl.data.prompts (+ data.synthetic): validation errors, length handling, shuffling,
DP sharding and resumable loading. All data is written to tmp_path."""
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.config import DataConfig
from hybridrl.data.prompts import (DataError, PromptDataset, PromptLoader, left_pad, make_train_loader,
                           make_val_loader)
from hybridrl.data.synthetic import ensure_synthetic_data, write_synthetic_arith
from hybridrl.tokenizer import load_tokenizer

from dist_helper import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


def row(content, truth="1", i=0):
    return {"data_source": "synthetic/arith", "prompt": [{"role": "user", "content": content}],
            "ability": "arith", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": i}}


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def arith_file(tmp_path, n, name="train.parquet"):
    # prompts of varying length so left padding is exercised
    return write(tmp_path / name, [row(f"{i}+{i % 7}=", str(i + i % 7), i) for i in range(n)])


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    assert left_pad([[1]], 9, length=3)[0].tolist() == [[9, 9, 1]]


def test_dataset_rows_and_batch_fields(tmp_path, tok):
    path = write(tmp_path / "d.parquet", [row("3+4=", "7", 0), row("12+1=", "13", 1)])
    ds = PromptDataset(path, tok, DataConfig())
    assert len(ds) == 2 and ds[0].input_ids == tok.encode("3+4=")
    batch = next(iter(PromptLoader(ds, 2, shuffle=False)))
    assert batch.input_ids.shape == (2, 5) and len(batch) == 2
    assert batch.input_ids[0].tolist() == [tok.pad_token_id] + tok.encode("3+4=")
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.raw_prompt == ["3+4=", "12+1="] and batch.ground_truth == ["7", "13"]
    assert batch.data_source == ["synthetic/arith"] * 2 and batch.index == [0, 1]
    assert batch.extra_info == [{"index": 0}, {"index": 1}]


def test_rows_of_two_files_have_their_own_index_and_seed(tmp_path, tok):
    """A row's index (what its sampling seed derives from) runs over the files in order: row 0 of a second file
    is not row 0 of the first (the same seed drew the same noise for both, correlating their samples)."""
    from hybridrl.trainer.ppo import prompt_seeds

    first = write(tmp_path / "a.parquet", [row("3+4=", "7", 0), row("12+1=", "13", 1)])
    second = write(tmp_path / "b.parquet", [row("5+5=", "10", 0), row("2+2=", "4", 1)])
    ds = PromptDataset([first, second], tok, DataConfig())
    assert [r.index for r in ds.rows] == [0, 1, 2, 3] and [r.file for r in ds.rows] == [first] * 2 + [second] * 2
    assert len(set(prompt_seeds(1, 5, [r.index for r in ds.rows]))) == 4


def test_plain_string_prompt_and_prompt_key(tmp_path, tok):
    rows = [{"data_source": "s", "question": "2+2=", "reward_model": {"ground_truth": "4"}}]
    path = write(tmp_path / "q.parquet", rows)
    ds = PromptDataset([path], tok, DataConfig(prompt_key="question"))
    assert ds[0].raw_prompt == "2+2=" and ds[0].extra_info == {}


def _error(tmp_path, tok, rows_or_path, **cfg):
    path = rows_or_path if isinstance(rows_or_path, str) else write(tmp_path / "bad.parquet",
                                                                   rows_or_path)
    with pytest.raises(DataError) as e:
        PromptDataset([path], tok, DataConfig(**cfg))
    assert path in str(e.value)
    return str(e.value)


def test_missing_file_and_not_parquet(tmp_path, tok):
    msg = _error(tmp_path, tok, str(tmp_path / "nope.parquet"))
    assert "does not exist" in msg and "data.train_files" in msg
    text = tmp_path / "text.parquet"
    text.write_text("question,answer\n1,2\n")
    assert "is not a parquet file" in _error(tmp_path, tok, str(text))


@pytest.mark.parametrize("column", ["prompt", "data_source", "reward_model"])
def test_missing_columns(tmp_path, tok, column):
    rows = [{k: v for k, v in row("1+1=").items() if k != column}]
    msg = _error(tmp_path, tok, rows)
    assert f"no column '{column}'" in msg and "it has" in msg
    if column == "prompt":
        assert "data.prompt_key" in msg


def test_wrong_types_in_rows(tmp_path, tok):
    bad_prompt = [dict(row("x"), prompt=5)]
    assert "row 0 column 'prompt'" in _error(tmp_path, tok, bad_prompt)
    no_content = [row("1+1="), row("1+2="), dict(row("x"), prompt=[{"role": "user"}])]
    msg = _error(tmp_path, tok, no_content)
    assert "row 2 column 'prompt'" in msg and "'content'" in msg
    no_truth = [row("1+1="), dict(row("x"), reward_model={"style": "rule", "ground_truth": None})]
    msg = _error(tmp_path, tok, no_truth)
    assert "row 1 column 'reward_model'" in msg and "ground_truth" in msg
    bad_source = [dict(row("x"), data_source=3)]
    assert "row 0 column 'data_source'" in _error(tmp_path, tok, bad_source)


def test_overlong_prompts_are_filtered_counted_and_logged(tmp_path, tok, caplog):
    rows = [row("1+1="), row("123456789+1="), row("2+2="), row("99999999+99999="), row("3+3=")]
    path = write(tmp_path / "long.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="hybridrl.data.prompts"):
        ds = PromptDataset(path, tok, DataConfig(max_prompt_length=6))
    assert len(ds) == 3 and ds.num_filtered == 2
    assert [r.index for r in ds.rows] == [0, 2, 4]
    assert any("filtered 2 of 5" in r.getMessage() and r.name == "hybridrl.data.prompts"
               for r in caplog.records)


def test_empty_after_filtering(tmp_path, tok):
    msg = _error(tmp_path, tok, [row("123456789+1=")], max_prompt_length=4)
    assert "no prompts left" in msg and "data.max_prompt_length" in msg


def test_truncation_left_right_error(tmp_path, tok):
    path = write(tmp_path / "t.parquet", [row("1+1="), row("123456789=")])
    cfg = dict(max_prompt_length=4, filter_overlong_prompts=False)
    left = PromptDataset(path, tok, DataConfig(truncation="left", **cfg))
    right = PromptDataset(path, tok, DataConfig(truncation="right", **cfg))
    assert left[1].input_ids == tok.encode("789=") and right[1].input_ids == tok.encode("1234")
    assert left[0].input_ids == right[0].input_ids == tok.encode("1+1=")
    msg = _error(tmp_path, tok, path, truncation="error", **cfg)
    assert "row 1 column 'prompt'" in msg and "10 tokens" in msg and "truncation" in msg


def test_epoch_orders_are_verls_sampler(tmp_path, tok):
    """verl's training sampler: torch's RandomSampler with a generator seeded once with data.seed, one permutation
    per epoch from the same generator (the orders were seed + epoch reseeded: verl's from the second epoch on
    differed); any epoch asked for in any order, and a fresh loader (a resumed run) agrees."""
    from torch.utils.data import RandomSampler

    ds = PromptDataset(arith_file(tmp_path, 20), tok, DataConfig())
    sampler = RandomSampler(range(20), generator=torch.Generator().manual_seed(5))
    verl = [list(sampler) for _ in range(4)]
    loader = PromptLoader(ds, 4, seed=5)
    assert [loader.epoch_order(e) for e in (0, 1, 2, 3)] == verl
    assert loader.epoch_order(1) == verl[1] and loader.epoch_order(3) == verl[3]  # back, then forward again
    assert PromptLoader(ds, 4, seed=5).epoch_order(2) == verl[2]


def test_per_epoch_shuffle_is_deterministic(tmp_path, tok):
    ds = PromptDataset(arith_file(tmp_path, 20), tok, DataConfig())
    a, b = PromptLoader(ds, 4, seed=3), PromptLoader(ds, 4, seed=3)
    assert a.epoch_order(0) == b.epoch_order(0) and a.epoch_order(1) == b.epoch_order(1)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert sorted(a.epoch_order(1)) == list(range(20))
    assert PromptLoader(ds, 4, seed=4).epoch_order(0) != a.epoch_order(0)
    assert PromptLoader(ds, 4, shuffle=False).epoch_order(5) == list(range(20))
    assert [x.index for x in a] == [x.index for x in b]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_sharding_is_disjoint_equal_and_covering(tmp_path, tok, dp_size):
    ds = PromptDataset(arith_file(tmp_path, 30), tok, DataConfig())
    reference = list(PromptLoader(ds, 8, seed=1))  # dp=1: 3 full batches, 6 prompts dropped
    assert len(reference) == 3
    shards = [list(PromptLoader(ds, 8, r, dp_size, seed=1)) for r in range(dp_size)]
    for k, ref in enumerate(reference):
        parts = [shards[r][k] for r in range(dp_size)]
        assert all(len(p) == 8 // dp_size for p in parts)
        assert [i for p in parts for i in p.index] == ref.index  # disjoint, in order, covering
        assert all(p.input_ids.shape[1] == ref.input_ids.shape[1] for p in parts)
        assert torch.equal(torch.cat([p.input_ids for p in parts]), ref.input_ids)


def test_batch_width_is_the_global_batch_longest_prompt(tmp_path, tok):
    """The prompt side is cut to the longest prompt of each global batch (the same on every DP
    rank), not padded to data.max_prompt_length; the workers trim each micro-batch further."""
    rows = [row("1+1=", i=i) for i in range(4)] + [row("123+45=", i=4)] + [row("1+2=", i=i) for i in range(5, 8)]
    ds = PromptDataset(write(tmp_path / "w.parquet", rows), tok, DataConfig(max_prompt_length=32))
    widths = [[b.input_ids.shape[1] for b in PromptLoader(ds, 4, r, 2, shuffle=False)] for r in range(2)]
    assert widths == [[4, 7], [4, 7]]  # batch 1: all 4 tokens; batch 2 holds the 7-token prompt
    # rank 1's half of batch 2 has only 4-token prompts and is padded to the global longest
    short_half = list(PromptLoader(ds, 4, 1, 2, shuffle=False))[1]
    assert short_half.attention_mask.sum(1).tolist() == [4, 4] and short_half.input_ids.shape[1] == 7


def test_loader_size_errors(tmp_path, tok):
    ds = PromptDataset(arith_file(tmp_path, 6), tok, DataConfig())
    with pytest.raises(DataError, match="not divisible by the data parallel size 4"):
        PromptLoader(ds, 6, 0, 4)
    with pytest.raises(DataError, match="fewer than one batch of 8"):
        PromptLoader(ds, 8)


def _take(loader, n):
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch.index)
            if len(out) == n:
                break
    return out


@pytest.mark.parametrize("stop", [2, 5, 7])  # mid-epoch, at an epoch boundary, in epoch 2
def test_resume_equals_uninterrupted(tmp_path, tok, stop):
    ds = PromptDataset(arith_file(tmp_path, 22), tok, DataConfig())  # 5 batches of 4 per epoch
    uninterrupted = _take(PromptLoader(ds, 4, 1, 2, seed=7), 12)
    first = PromptLoader(ds, 4, 1, 2, seed=7)
    head = _take(first, stop)
    state = first.state_dict()
    resumed = PromptLoader(ds, 4, 1, 2, seed=7)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 12 - stop) == uninterrupted
    assert state["epoch"] == stop // 5 and state["batch_index"] == stop % 5


def test_a_drawn_seed_gives_way_to_the_checkpoints_and_a_set_one_does_not(tmp_path, tok):
    """data.seed null: the loader's seed was drawn for this run, and a resume goes on with the order the checkpoint's
    run started with; a seed set in the config must match the checkpoint's."""
    ds = PromptDataset(arith_file(tmp_path, 22), tok, DataConfig())
    uninterrupted = _take(PromptLoader(ds, 4, 1, 2, seed=7), 12)
    first = PromptLoader(ds, 4, 1, 2, seed=7, seed_drawn=True)
    head = _take(first, 3)
    state = first.state_dict()
    resumed = PromptLoader(ds, 4, 1, 2, seed=999, seed_drawn=True)
    assert _take(PromptLoader(ds, 4, 1, 2, seed=999), 3) != head  # another seed, another order
    resumed.load_state_dict(state)
    assert resumed.seed == 7 and head + _take(resumed, 9) == uninterrupted
    with pytest.raises(DataError, match="seed=7"):
        PromptLoader(ds, 4, 1, 2, seed=999).load_state_dict(state)


def _drawn_loaders(tmp, data):
    from hybridrl.config.io import load_config
    from hybridrl.parallel.distributed import agreed_random_seed
    from hybridrl.trainer.loop import setup_run

    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                      [f"data.train_files=[{data}]", f"data.val_files=[{data}]", "data.seed=null",
                       f"trainer.default_local_dir={tmp}"])
    loader = setup_run(cfg)[4]
    return loader.seed, loader.seed_drawn, [agreed_random_seed() for _ in range(2)]


@pytest.mark.distributed
def test_a_null_data_seed_is_drawn_once_and_shared_by_every_rank(tmp_path):
    """verl's default data.seed is null: the run draws one (rank 0's, broadcast), so every DP rank shuffles alike."""
    data = arith_file(tmp_path, 40)
    ranks = run_distributed(_drawn_loaders, 2, str(tmp_path), data)
    assert ranks[0] == ranks[1] and ranks[0][1] is True
    assert len({ranks[0][0], *ranks[0][2]}) == 3  # fresh draws differ (a 2^-31 coincidence aside)


def test_resume_with_other_batch_size_fails(tmp_path, tok):
    ds = PromptDataset(arith_file(tmp_path, 22), tok, DataConfig())
    state = PromptLoader(ds, 4).state_dict()
    with pytest.raises(DataError, match="batch_size=4"):
        PromptLoader(ds, 2).load_state_dict(state)


def test_val_loader_keeps_the_last_short_batch(tmp_path, tok):
    train, test = write_synthetic_arith(str(tmp_path / "arith"), n_train=40, n_test=10, seed=0)
    cfg = DataConfig(train_files=[train], val_files=[test], train_batch_size=16, val_batch_size=4)
    batches = [make_val_loader(cfg, tok, r, 2) for r in range(2)]
    sizes = [[len(b) for b in loader] for loader in batches]
    assert sizes == [[2, 2, 1], [2, 2, 1]]
    assert len(make_train_loader(cfg, tok, 0, 2)) == 2


def test_synthetic_arith_rows(tmp_path, tok):
    train, test = write_synthetic_arith(str(tmp_path), n_train=50, n_test=5, seed=0)
    ds = PromptDataset([train], tok, DataConfig())
    for r in ds.rows:
        a, b = r.raw_prompt[:-1].split("+")
        assert r.ground_truth == str(int(a) + int(b)) and r.data_source == "synthetic/arith"
        assert len(r.input_ids) == 4
    again, _ = write_synthetic_arith(str(tmp_path / "again"), n_train=50, n_test=5, seed=0)
    assert pq.read_table(train).equals(pq.read_table(again))  # deterministic
    assert len(PromptDataset([test], tok, DataConfig())) == 5


def test_ensure_synthetic_data(tmp_path):
    cfg = DataConfig(train_files=[str(tmp_path / "a" / "train.parquet")],
                     val_files=[str(tmp_path / "a" / "test.parquet")], synthetic_task="arith")
    assert len(ensure_synthetic_data(cfg, n_train=30, n_test=6)) == 2
    assert pq.read_table(cfg.val_files[0]).num_rows == 6
    assert ensure_synthetic_data(cfg) == []  # present now
    off = DataConfig(train_files=[str(tmp_path / "b.parquet")], synthetic_task="")
    assert ensure_synthetic_data(off) == []


def test_prompt_the_chat_template_rejects_names_file_and_row(tmp_path):
    from hybridrl.tokenizer import HFTokenizer, build_tiny_hf_tokenizer

    hf = build_tiny_hf_tokenizer()
    hf.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                        "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    strict = HFTokenizer(hf, "strict-template")
    good, bad = row("1+2="), row("3+4=")
    bad["prompt"] = [{"role": "user", "content": "3+"}, {"role": "user", "content": "4="}]
    path = write(tmp_path / "roles.parquet", [good, bad])
    with pytest.raises(DataError) as e:
        PromptDataset([path], strict, DataConfig(max_prompt_length=64))
    msg = str(e.value)
    assert f"data file '{path}' row 1 column 'prompt'" in msg and "'strict-template'" in msg
    assert "Conversation roles must alternate" in msg and "['user', 'user']" in msg


def test_float_ground_truths(tmp_path, tok):
    """A float answer column (pandas writes GSM8K's 72 as 72.0) means the text a response gives: '72'."""
    path = write(tmp_path / "floats.parquet", [row("1+2=", 72.0), row("1+2=", 2.5), row("1+2=", -3.0)])
    assert [r.ground_truth for r in PromptDataset([path], tok, DataConfig())] == ["72", 2.5, "-3"]
    for bad in (float("nan"), float("inf")):
        msg = _error(tmp_path, tok, [row("1+2=", 4.0), row("1+2=", bad)])
        assert "row 1 column 'reward_model'" in msg and f"ground_truth is {bad}" in msg


def test_missing_data_file_is_an_error_unless_synthetic_data_is_asked_for(tmp_path, tok):
    typo = str(tmp_path / "gsm8k" / "trian.parquet")
    cfg = DataConfig(train_files=[typo], val_files=[typo])
    assert cfg.synthetic_task == ""
    assert ensure_synthetic_data(cfg) == [] and not (tmp_path / "gsm8k").exists()
    with pytest.raises(DataError) as e:
        make_train_loader(cfg, tok)
    msg = str(e.value)
    assert typo in msg and "does not exist" in msg
    assert "prepare_gsm8k.py" in msg and "data.synthetic_task=arith" in msg


def test_home_in_data_paths_is_expanded(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(train_files=["~/arith/train.parquet"], val_files=["~/arith/test.parquet"],
                     synthetic_task="arith", train_batch_size=4)
    written = ensure_synthetic_data(cfg, n_train=12, n_test=3)
    assert written == [str(tmp_path / "home" / "arith" / name) for name in ("train.parquet", "test.parquet")]
    assert not (tmp_path / "~").exists()
    assert len(make_train_loader(cfg, tok).dataset) == 12 and len(make_val_loader(cfg, tok).dataset) == 3


def test_unknown_synthetic_task_is_a_config_error(tmp_path):
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config

    with pytest.raises(ConfigError, match="data.synthetic_task='arihh' is not one of arith, arith_tools, or empty"):
        load_config("", ["data.synthetic_task=arihh"])
    assert load_config("", ["data.synthetic_task=arith_tools"]).data.synthetic_task == "arith_tools"


def test_make_synthetic_data_script(tmp_path):
    import os
    import runpy

    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "make_synthetic_data.py")
    main = runpy.run_path(script)["main"]
    main(["--output_dir", str(tmp_path), "--n_train", "12", "--n_test", "3", "--seed", "5"])
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 12
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 3


@pytest.mark.parametrize("suffix,array", [(".jsonl", False), (".json", True), (".json", False)])
def test_json_files_read_as_the_same_parquet_rows(tmp_path, tok, suffix, array):
    """verl also reads .json / .jsonl data files (its load_dataset("json")): the same rows as JSON give the same
    prompts, ground truths and extra_info as the parquet file (an array or one record per line)."""
    import json

    rows = [row(f"{i}+{i}=", str(2 * i), i) for i in range(5)]
    parquet = tmp_path / "rows.parquet"
    write(str(parquet), rows)
    path = tmp_path / f"rows{suffix}"
    path.write_text(json.dumps(rows) if array else "\n".join(json.dumps(r) for r in rows) + "\n")
    want, got = (PromptDataset([str(p)], tok, DataConfig()) for p in (parquet, path))
    assert [(r.input_ids, r.ground_truth, r.extra_info, r.data_source) for r in got.rows] == \
        [(r.input_ids, r.ground_truth, r.extra_info, r.data_source) for r in want.rows]


def test_malformed_json_names_the_line(tmp_path, tok):
    import json

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row("1+1=")) + "\n{not json\n")
    assert "line 2 is not a JSON record" in _error(tmp_path, tok, str(path))
    listed = tmp_path / "list.jsonl"
    listed.write_text(json.dumps(row("1+1=")) + "\n[1, 2]\n")
    assert "row 1 is a list, not an object" in _error(tmp_path, tok, str(listed))


def test_json_records_keep_the_keys_the_first_record_lacks(tmp_path, tok):
    """pyarrow's from_pylist takes the columns of the first record only: a later record's extra_info was dropped."""
    import json

    first = {k: v for k, v in row("1+1=", "2", 0).items() if k != "extra_info"}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(row("2+2=", "4", 1)) + "\n")
    got = PromptDataset([str(path)], tok, DataConfig()).rows
    assert [r.extra_info for r in got] == [{}, {"index": 1}]
