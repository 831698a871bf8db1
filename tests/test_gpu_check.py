"""benchmarks/gpu_check.sh and bench_gpu.py, checked on CPU before the GPU run they prepare.

The wheels the device lacks are requirements.txt's pins; a run without them (or with a broken one)
stops before any stage with exit 3; stage limits that overrun the budget are refused up front; the
handoff measurement covers both of the handoff's paths, and the MFU row names the attention that ran.
(`gpu_check.sh --smoke` runs every stage tiny on CPU: too long for the suite.)
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from dist_helper import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ("env", "tests", "grpo", "bench", "resume")


def _run(tmp_path, **env):
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env})


def test_the_carried_wheels_are_the_pins_of_requirements():
    wheels = re.search(r'^WHEELS="([^"]+)"', SCRIPT.read_text(), re.M).group(1).split()
    pins = dict(line.strip().split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert {w.split("==")[0] for w in wheels} >= {"megatron-core", "omegaconf"}
    assert all(pins[name] == version for name, version in (w.split("==") for w in wheels)), wheels


@pytest.mark.parametrize("wheels", ["none", "broken"])
def test_a_failed_wheel_install_ends_the_run_before_any_stage(tmp_path, wheels):
    folder = tmp_path / "whl"
    folder.mkdir()
    if wheels == "broken":  # every pinned name there, none of them a zip
        for name in ("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64", "omegaconf-2.4.0-py3-none-any",
                     "transformers-5.24.0-py3-none-any"):
            (folder / f"{name}.whl").write_text("not a wheel")
    result = _run(tmp_path, WHEEL_DIR=str(folder))
    assert result.returncode == 3, result.stdout + result.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| wheels | FAIL" in summary
    assert not [s for s in STAGES if f"| {s} |" in summary], summary
    assert ("megatron-core==0.16.1" if wheels == "none" else "not an intact wheel") in result.stderr


def test_stage_limits_over_the_budget_are_refused(tmp_path):
    result = _run(tmp_path, BUDGET_S="100")
    assert result.returncode == 2 and "add up to" in result.stderr


def _bench_parts():
    """bench_gpu's MFU and handoff measurements at its smoke sizes on CPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_gpu

    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.native import NativeEngine

    bench_gpu.SIZE.update(bench_gpu.SMOKE)
    bench_gpu.DEVICE = "cpu"
    groups = init_model_parallel(1, 1)
    model, spec = bench_gpu.build(bench_gpu.config_spec("qwen2_0.5b", smoke=True))
    mfu = bench_gpu.actor_mfu(model, spec)
    engine = NativeEngine(spec, 1, dtype="bfloat16", pad_id=0, eos_id=None, max_num_seqs=4)
    engine.load_weights([(n, t.detach().clone()) for n, t in mcore_to_hf_stream(model, spec, groups)])
    hand = bench_gpu.handoff(engine, model, spec, groups)
    return mfu, hand, bench_gpu.report({"qwen2_0.5b": mfu}, {}, hand, [], {})


@pytest.mark.distributed
def test_bench_gpu_measures_both_handoff_paths_and_names_the_attention():
    mfu, hand, table = run_distributed(_bench_parts, 1)[0]
    assert mfu["layer_spec"] == "local layer spec, SDPAttention"
    assert "(local layer spec, SDPAttention)" in table
    assert hand["direct"]["bytes"] >= hand["resharded"]["bytes"] > 0.9 * hand["direct"]["bytes"]  # vocab padding
    assert hand["resharded"]["buckets"] >= 1
    for path in ("direct", "resharded"):
        assert hand[path]["verified"] > 0 and hand[path]["unverified"] > 0
        assert f"handoff verified, {path} path" in table and f"handoff unverified, {path} path" in table
