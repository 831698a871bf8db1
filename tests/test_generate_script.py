"""scripts/generate.py: greedy tokens equal transformers' `generate` for Qwen3, Qwen3-MoE (norm_topk_prob
true and false) and Mixtral, in one process (TP 1) and under torchrun with 2 processes (rollout TP 2,
and TP 1 with the prompts split over 2 groups); text prompts through the folder's tokenizer stop at its
eos; bad input ends in exit code 2 and one `error:` line naming the problem and the fix."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dist_helper import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "generate.py")
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [40, 41, 42, 43], [100, 7, 250]]
NEW = 8
CASES = {"qwen3": dict(model_type="qwen3"),
         "qwen3_moe_norm": dict(model_type="qwen3_moe", norm_topk_prob=True),
         "qwen3_moe_raw": dict(model_type="qwen3_moe", norm_topk_prob=False),
         "mixtral": dict(model_type="mixtral")}
COMMON = dict(num_hidden_layers=3, vocab_size=253, head_dim=24)
TEXTS = ["3+4=", "hello world", "12*7"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    root = str(tmp_path_factory.mktemp("generate"))
    return {name: random_hf_model_folder(os.path.join(root, name), seed=20 + i, **COMMON, **kw)
            for i, (name, kw) in enumerate(CASES.items())}


def _write_prompts(path, lines):
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return str(path)


def _generate(folder, prompts_file, out, *extra, procs=1, tp=1):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = [sys.executable, SCRIPT] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={free_port()}",
        SCRIPT]
    args = ["--model", folder, "--prompts-file", prompts_file, "--output", out, "--max-new-tokens", NEW,
            "--tensor-parallel-size", tp, *extra]
    return subprocess.run([*launcher, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)


def _read(out):
    with open(out) as f:
        return [json.loads(line) for line in f]


def _hf_generate(folder, prompts, eos=None):
    import transformers

    from models_helper import hf_greedy

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = hf_greedy(model, prompts, NEW, eos).tolist()
    stops = [eos] if isinstance(eos, int) else eos or []
    ends = [min([row.index(s) + 1 for s in stops if s in row] or [len(row)]) for row in rows]
    return [row[:end] for row, end in zip(rows, ends)]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_transformers(folders, tmp_path, name):
    prompts_file = _write_prompts(tmp_path / "prompts.jsonl", [{"prompt_token_ids": p} for p in PROMPTS])
    hf = _hf_generate(folders[name], PROMPTS)
    expected = [{"prompt_token_ids": p, "output_token_ids": o} for p, o in zip(PROMPTS, hf)]
    # (processes, rollout TP): one launch per family, every layout covered once (the engine itself is checked
    # against transformers at every TP in test_rollout_moe.py; this is the script around it)
    layouts = {"qwen3": [(1, 1)], "qwen3_moe_norm": [(2, 2)], "qwen3_moe_raw": [(1, 1)], "mixtral": [(2, 1)]}[name]
    for procs, tp in layouts:
        out = str(tmp_path / f"out_{procs}_{tp}.jsonl")
        proc = _generate(folders[name], prompts_file, out, procs=procs, tp=tp)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _read(out) == expected, f"{name}: {procs} process(es), TP {tp}"


@pytest.mark.distributed
def test_text_prompts_stop_at_the_tokenizers_eos(folders, tmp_path):
    from hybridrl.tokenizer import load_tokenizer, save_tiny_tokenizer

    folder = str(tmp_path / "qwen3_tok")
    shutil.copytree(folders["qwen3"], folder)
    save_tiny_tokenizer(folder)
    lines = [{"prompt": t} for t in TEXTS] + [{"prompt_token_ids": PROMPTS[1]}]
    ids = [load_tokenizer(folder).encode(t) for t in TEXTS] + [PROMPTS[1]]
    # a second eos (generation_config.json, as Qwen's <|im_end|>) that the model emits mid-row: rows stop early
    stop = _hf_generate(folder, ids)[0][2]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, stop]}, f)
    tok = load_tokenizer(folder)
    assert tok.eos_token_ids == (1, stop)
    hf = _hf_generate(folder, ids, eos=list(tok.eos_token_ids))
    assert len(hf[0]) <= 3, hf
    proc = _generate(folder, _write_prompts(tmp_path / "text.jsonl", lines), str(tmp_path / "out.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _read(tmp_path / "out.jsonl")
    assert [g["prompt_token_ids"] for g in got] == ids
    assert [g["output_token_ids"] for g in got] == hf
    assert [g["text"] for g in got] == [tok.decode(o) for o in hf]


def _error_cases(tmp, folders):
    good = _write_prompts(tmp / "good.jsonl", [{"prompt_token_ids": [5, 6]}])
    bad_json = tmp / "bad.jsonl"
    bad_json.write_text('{"prompt_token_ids": [5]}\n\n{"prompt": \n')
    gpt2 = tmp / "gpt2"
    shutil.copytree(folders["qwen3"], gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    q3 = folders["qwen3"]
    return [  # (arguments, fragments the error line must hold)
        (["--model", tmp / "nope", "--prompts-file", good], ["--model", "no such folder", "pass an HF model folder"]),
        (["--model", q3, "--prompts-file", tmp / "none.jsonl"], ["none.jsonl: no such file", "pass a JSONL file"]),
        (["--model", q3, "--prompts-file", bad_json], ["bad.jsonl line 3 is not JSON", "each line must be"]),
        (["--model", q3, "--prompts-file", _write_prompts(tmp / "text.jsonl", [{"prompt": "hi"}])],
         ["line 1: a text prompt needs a tokenizer", "pass prompt_token_ids"]),
        (["--model", q3, "--prompts-file", _write_prompts(tmp / "oov.jsonl", [{"prompt_token_ids": [5, 999]}])],
         ["line 1: prompt_token_ids must be a list of token ids in [0, 253)"]),
        (["--model", q3, "--prompts-file", _write_prompts(tmp / "neither.jsonl", [{"text": "x"}])],
         ["line 1: expected one of the keys prompt / prompt_token_ids"]),
        (["--model", gpt2, "--prompts-file", good], ["model_type='gpt2'", "supported: qwen2, qwen3"]),
        (["--model", q3, "--prompts-file", good, "--tensor-parallel-size", "3"],
         ["--tensor-parallel-size 3 does not fit", "num_key_value_heads=2 is not divisible by tp=3"]),
        (["--model", q3, "--prompts-file", good, "--tensor-parallel-size", "2"],
         ["--tensor-parallel-size 2 does not divide the 1 process(es)", "torchrun --nproc_per_node"]),
        (["--model", q3, "--prompts-file", good, "--output", tmp / "no_dir" / "o.jsonl"],
         ["no_dir does not exist", "create it"]),
        (["--model", q3, "--prompts-file", good, "--temperature", "-1"], ["--temperature -1.0", "temperature >= 0"]),
        (["--model", q3, "--prompts-file", good, "--tensor-parallel-size", "0"], ["--tensor-parallel-size 0: pass 1"]),
    ]


def _one_error_line(code, err, args):
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (args, err[-2000:])
    return lines[0]


def test_bad_input_is_one_error_line(folders, tmp_path, capsys):
    from hybridrl.rollout.generate_cli import main

    cases = _error_cases(tmp_path, folders)
    for args, fragments in cases:  # every check runs before any process group: in this process
        args = [str(a) for a in args] + ([] if "--output" in args else ["--output", str(tmp_path / "out.jsonl")])
        line = _one_error_line(main(args), capsys.readouterr().err, args)
        for fragment in fragments:
            assert fragment in line, (args, fragment, line)
    args, fragments = cases[2]  # and the script itself, once
    proc = subprocess.run([sys.executable, SCRIPT, *map(str, args), "--output", str(tmp_path / "o.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert fragments[0] in _one_error_line(proc.returncode, proc.stderr, args)
