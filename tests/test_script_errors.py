"""Every script fails like train_ppo.py: bad input ends in exit code 2 and one `error:` line naming the
problem and the fix, never a traceback (hybridrl.log.run_cli); a bug keeps its traceback.
convert_checkpoint.py's cases are in test_convert_script.py, checkpoint saves in test_checkpoint.py."""
import errno
import os
import subprocess
import sys

import pytest

from hybridrl.log import EXIT_USER_ERROR, UsageError, os_error_message, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raises(err):
    def main():
        raise err
    return main


def _one_error_line(err_text):
    lines = [line for line in err_text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err_text, err_text[-3000:]
    return lines[0]


def test_run_cli_maps_user_errors_and_keeps_bugs(capsys, tmp_path):
    from hybridrl.config import ConfigError
    from hybridrl.data.prompts import DataError

    assert run_cli(lambda: None) == 0 and run_cli(lambda code: code, 3) == 3
    for err, text in ((UsageError("--n 0: pass 1 or more"), "error: --n 0: pass 1 or more"),
                      (ConfigError("x.y must be > 0"), "error: x.y must be > 0"),
                      (DataError("no rows; fix data.train_files"), "error: no rows; fix data.train_files")):
        assert run_cli(_raises(err)) == EXIT_USER_ERROR
        assert _one_error_line(capsys.readouterr().err) == text
    # the file system refusing a named path: the path, what happened and the fix
    missing = tmp_path / "nope" / "f.json"
    assert run_cli(lambda: open(missing)) == EXIT_USER_ERROR
    assert _one_error_line(capsys.readouterr().err) == f"error: No such file or directory: {missing}; check the path"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out"))
    assert run_cli(_raises(full)) == EXIT_USER_ERROR
    assert "free space there" in _one_error_line(capsys.readouterr().err)
    assert os_error_message(OSError(errno.EFBIG, "File too large"), "/ckpt/x") == (
        "File too large: /ckpt/x; the file outgrew the size limit (ulimit -f); raise it or pass a folder on another disk")
    # bugs are not user errors: a plain KeyError, an OSError that names no path
    with pytest.raises(KeyError):
        run_cli(_raises(KeyError("k")))
    with pytest.raises(OSError):
        run_cli(_raises(OSError(errno.EIO, "I/O error")))


def test_a_run_that_ended_tears_down_its_process_groups(tmp_path):
    """train_ppo.py / train_rm.py / train_sft.py destroy the process groups of a run that returned (left to the
    interpreter's exit, a rank can abort after its run succeeded); a run that failed keeps them."""
    import argparse

    import torch.distributed as dist

    from hybridrl.config import ConfigError
    from hybridrl.trainer.entry import run_with_config

    args = argparse.Namespace(config=os.path.join(ROOT, "configs", "tiny_cpu.yaml"), overrides=[])

    def run(cfg, fail=False):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{len(os.listdir(tmp_path))}",
                                    rank=0, world_size=1)
        if fail:
            raise ConfigError("x.y must be > 0")
        return 5

    try:
        assert run_with_config(args, lambda cfg: run(cfg, fail=True)) == EXIT_USER_ERROR
        assert dist.is_initialized()
        assert run_with_config(args, run) == 5
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(script, *args, timeout=180):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _cases(tmp):
    a_file = tmp / "a_file"
    a_file.write_text("not a folder")
    (tmp / "not_a_trace.json").write_text('{"model_type": "gpt2"}')
    (tmp / "empty_trace.json").write_text('{"traceEvents": [{"ph": "M", "name": "thread_name", "tid": 0}]}')
    return [  # (script and args, fragments the error line must hold)
        (("prepare_gsm8k.py", "--input", tmp / "no_gsm8k", "--output_dir", tmp / "out"),
         ["GSM8k input", "does not exist", "pass local train/test files"]),
        (("prepare_gsm8k.py", "--input", tmp / "not_a_trace.json", "--output_dir", tmp / "out"),
         ["cannot tell the split", "name GSM8k files train*"]),
        (("make_synthetic_data.py", "--output_dir", a_file), [f"File exists: {a_file}", "move it away"]),
        (("make_synthetic_data.py", "--output_dir", tmp / "arith", "--n_train", "0"),
         ["--n_train 0", "pass --n_train 1 or more"]),
        (("plot_timeline.py", tmp / "missing.json", "-o", tmp / "t.png"), ["missing.json: no such file",
                                                                           "trainer.timeline_dir"]),
        (("plot_timeline.py", tmp / "not_a_trace.json", "-o", tmp / "t.png"),
         ["is not a Chrome-trace JSON file (KeyError: 'traceEvents')", "trainer.timeline_dir"]),
        (("plot_timeline.py", tmp / "empty_trace.json", "-o", tmp / "t.png"), ["no complete ('X') events"]),
        (("plan_layout.py", "--config", tmp / "missing.yaml"), ["missing.yaml' does not exist", "pass --config"]),
        (("plan_layout.py", "--config", "configs/qwen2_7b.yaml", "--placement", "auto", "--profile-json",
          tmp / "missing.json"), [f"No such file or directory: {tmp / 'missing.json'}", "check the path"]),
        (("train_sft.py", "--config", "configs/tiny_cpu.yaml", "sft.micro_batch_size_per_gpu=0"),
         ["sft.micro_batch_size_per_gpu must be > 0"]),
        (("train_rm.py", "--config", "configs/tiny_cpu_rm.yaml", f"data.train_files=[{tmp}/none.parquet]",
          "data.synthetic_task=''", f"trainer.default_local_dir={tmp}/ckpt"),
         [f"data file '{tmp}/none.parquet' does not exist", "fix data.train_files"]),
    ]


def test_every_script_fails_with_one_error_line(tmp_path):
    for args, fragments in _cases(tmp_path):
        proc = _run(*args)
        assert proc.returncode == EXIT_USER_ERROR, (args, proc.stderr[-3000:])
        line = _one_error_line(proc.stderr)
        for fragment in fragments:
            assert fragment in line, (args, fragment, line)
