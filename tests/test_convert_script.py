"""scripts/convert_checkpoint.py: HF -> megatron (torchrun, TP=2 PP=2) -> HF loads cleanly in transformers,
bit-exact; world size 1 writes the same shards; errors surface with the tensor/field named."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from hybridrl.models.hf_checkpoint import SafetensorsReader, random_hf_model_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "convert_checkpoint.py")


def _script():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return random_hf_model_folder(str(tmp_path_factory.mktemp("src") / "llama"), "llama", seed=11,
                                  tie_word_embeddings=True, num_hidden_layers=4, vocab_size=199)


def test_torchrun_round_trip_loads_in_transformers(hf_folder, tmp_path):
    import transformers

    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "hf")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
                    "hf-to-mcore", "--input", hf_folder, "--output", mcore, "--tp", "2", "--pp", "2"],
                   check=True, env=env, capture_output=True)
    assert sorted(os.listdir(mcore)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001",
                                         "spec.json"]
    subprocess.run([sys.executable, SCRIPT, "mcore-to-hf", "--input", mcore, "--output", back],
                   check=True, env=env, capture_output=True)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    src, out = SafetensorsReader(hf_folder), SafetensorsReader(back)
    assert sorted(out.names()) == sorted(src.names()) and "lm_head.weight" not in out.names()
    for name in src.names():
        assert torch.equal(out.read(name), src.read(name)), name
    # the world-size-1 conversion writes the same shards the two torchrun processes wrote
    from hybridrl.models.mcore_checkpoint import load_rank_state

    single = str(tmp_path / "single")
    assert _script().main(["hf-to-mcore", "--input", hf_folder, "--output", single, "--tp", "2", "--pp", "2"]) == 0
    for t in range(2):
        for p in range(2):
            a, b = load_rank_state(mcore, t, p), load_rank_state(single, t, p)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _one_error(capsys, code, *fragments):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_script_errors_name_the_problem(hf_folder, tmp_path, capsys):
    script = _script()
    code = script.main(["hf-to-mcore", "--input", hf_folder, "--output", str(tmp_path / "x"), "--tp", "4"])
    _one_error(capsys, code, "--tp 4 --pp 1 does not fit", "num_key_value_heads=2 is not divisible by tp=4")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = open(os.path.join(hf_folder, "config.json")).read().replace('"silu"', '"gelu"')
    (bad / "config.json").write_text(cfg)
    _one_error(capsys, script.main(["hf-to-mcore", "--input", str(bad), "--output", str(tmp_path / "y")]),
               "hidden_act='gelu'")
    _one_error(capsys, script.main(["mcore-to-hf", "--input", str(bad), "--output", str(tmp_path / "z")]),
               "has no spec.json", "hf-to-mcore")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _one_error_line(proc, *fragments):
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_bad_input_through_the_command_line(tmp_path):
    """Issue 33's cases, as a user meets them: an unsupported HF folder, a missing megatron folder."""
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    _one_error_line(_run("hf-to-mcore", "--input", str(gpt2), "--output", str(tmp_path / "a")),
                    "model_type='gpt2'", "supported: ")
    _one_error_line(_run("mcore-to-hf", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "b")),
                    f"--input {tmp_path / 'missing'}: no such folder", "hf-to-mcore")
    _one_error_line(_run("ckpt-to-hf", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "c")),
                    "no such folder", "global_step_*")
