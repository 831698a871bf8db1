"""slurm/ppo.sh on a real SLURM cluster, end to end: sbatch on a CPU-only node (the GPU directive overridden
on the command line, the process count taken from the allocation), the pre-emption signal sent the way SLURM
sends it, the save, the requeue under the same job id and the resumed run, all read from the job's log.

Needs a running cluster with a free node: scripts/slurm_local_cluster.sh starts one on this machine (.ci/run
does before `make test`); without one the tests skip and say so. Each job runs 2 ranks of the tiny config; a
reward that sleeps 0.1 s per response keeps every step at 0.4 s or more, so the signals land mid-run."""
import functools
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from dist_helper import free_port
from test_trainer import FAST, ROOT


@functools.lru_cache(maxsize=None)
def _cluster_problem() -> str:
    """Why no test job can run here ("" when a node takes jobs, now or once its running job ends)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no SLURM client (sinfo/sbatch) on PATH; start a local cluster: sudo scripts/slurm_local_cluster.sh"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s; start a local cluster: sudo scripts/slurm_local_cluster.sh"
    states = proc.stdout.split()
    # a node busy with the other test's job counts (the two tests may run at once on two pytest workers): this
    # test's job queues until it is free
    if proc.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states):
        return (f"no SLURM node up (sinfo: {proc.stdout.strip() or proc.stderr.strip() or 'nothing'}); "
                "start a local cluster: sudo scripts/slurm_local_cluster.sh")
    return ""


pytestmark = pytest.mark.slow

SLOW_REWARD = "import time\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n" \
              "    time.sleep(0.1)\n    return 0.5\n"
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture
def submit_dir(tmp_path):
    """A submit folder that looks like the repository to the template (its logs/, runs/ and checkpoints/
    land here); jobs still queued or running at the end are cancelled. Skips, saying why, without a cluster."""
    if _cluster_problem():
        pytest.skip(_cluster_problem())
    for name in ("scripts", "configs", "slurm"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "logs").mkdir()
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    jobs = []
    yield tmp_path, jobs
    for job in jobs:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


def _submit(submit, name, sbatch_args, overrides, **env_extra) -> str:
    tmp, jobs = submit
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_")) and k not in ("GPUS_PER_NODE", "OMP_NUM_THREADS", "MASTER_PORT")}
    env.update(PATH=f"{os.path.dirname(sys.executable)}:{env['PATH']}", RDZV_PORT=str(free_port()), **env_extra)
    args = FAST + [f"data.train_files=[{tmp}/data/train.parquet]", f"data.val_files=[{tmp}/data/test.parquet]",
                   f"reward.custom_function.path={tmp}/slow_reward.py", "reward.custom_function.name=score",
                   "trainer.log_freq=1"] + overrides
    proc = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", "--gpus-per-node=0", "--time=00:15:00",
                           *sbatch_args, "slurm/ppo.sh", "configs/tiny_cpu.yaml", *args],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobs.append(proc.stdout.strip().split(";")[0])
    return jobs[-1]


def _job(job) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(log, pattern, job, timeout, start=0):
    """The first match of `pattern` in the job's log at or after offset `start`; fails early if the job ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        m = re.compile(pattern).search(text, start)
        if m:
            return m
        if _job(job).get("JobState") in FINAL:
            break
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} not in the log of job {job} ({_job(job).get('JobState')}):\n"
                         f"{(log.read_text() if log.exists() else '')[-4000:]}")


def _finished(log, job, timeout) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job(job)
        if info.get("JobState") in FINAL:
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {_job(job).get('JobState')} after {timeout} s:\n{log.read_text()[-4000:]}")


def _stop_and_resume(text, job, reason_pattern, start=0):
    """The step K of the first `saved on signal at step K (<reason>)` after `start`, checked to be followed by
    the requeued run resuming from global_step_K and training step K + 1; returns (K, offset after it)."""
    saved = re.compile(rf"saved on signal at step (\d+) \(({reason_pattern})\): checkpoints/{job}/global_step_\1")
    m = saved.search(text, start)
    assert m, text[start:][-4000:]
    step = int(m.group(1))
    resumed = re.compile(rf"job {job}: 1 node\(s\) x 2 .*\n(?:.*\n)*?resumed from checkpoints/{job}/global_step_{step} "
                         rf"at step {step}\n(?:.*\n)*?step:{step + 1} ").search(text, m.end())
    assert resumed, text[m.end():][-4000:]
    return step, resumed.end()


def test_preempted_job_saves_requeues_and_resumes(submit_dir):
    """`--signal=B:USR1@300` signals the batch shell only (scancel --batch); a pre-emption notice sent to every
    process (scancel --full) must end the same way: both save, requeue under the same id and resume."""
    tmp = submit_dir[0]
    total = 14
    job = _submit(submit_dir, "preempt", ["--cpus-per-task=2"], [f"trainer.total_training_steps={total}"])
    log = tmp / "logs" / f"preempt-{job}.out"
    _wait(log, r"\nstep:2 ", job, timeout=240)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    resumed = _wait(log, r"resumed from ", job, timeout=240)  # the requeued job may wait for the node
    _wait(log, r"\nstep:\d+ ", job, timeout=120, start=resumed.end())
    subprocess.run(["scancel", "--signal=USR1", "--full", job], check=True, timeout=30)
    info = _finished(log, job, timeout=240)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
    assert info["Restarts"] == "2", info  # requeued twice, under the same job id
    assert text.count(f"job {job}: 1 node(s) x 2 CPU processes") == 3  # append mode: the three runs in one log
    assert "layout: world=2" in text  # the process count came from --cpus-per-task=2
    first, after = _stop_and_resume(text, job, rf"stop file checkpoints/{job}/STOP")
    second, _ = _stop_and_resume(text, job, rf"SIGUSR1|stop file checkpoints/{job}/STOP", after)
    assert second > first
    for step in (first, second):
        assert (tmp / "checkpoints" / job / f"global_step_{step}" / "meta.json").is_file()
    assert re.search(rf"\nstep:{total} ", text) and not os.path.exists(tmp / "checkpoints" / job / "STOP")
    assert text.count("requeueing") == 2


def test_job_that_reaches_max_runtime_saves_requeues_and_resumes(submit_dir):
    """trainer.max_runtime counts from the process's start, so at 1 s it is spent before the first step: each
    run still trains one step (as Megatron-LM's exit duration, checked after a step), saves, stops and is
    requeued; the next run resumes from that save and, its limit met at the last step, ends as planned. 2 steps
    take exactly 2 runs, whatever the start-up costs."""
    tmp = submit_dir[0]
    total = 2
    job = _submit(submit_dir, "maxrt", ["--cpus-per-task=2"],
                  [f"trainer.total_training_steps={total}", "trainer.max_runtime=00:00:01"])
    log = tmp / "logs" / f"maxrt-{job}.out"
    info = _finished(log, job, timeout=300)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-4000:])
    stops, after = [], 0
    while "saved on signal" in text[after:]:
        step, after = _stop_and_resume(text, job, "time limit", after)
        stops.append(step)
    assert stops == [1] and int(info["Restarts"]) == 1, (stops, info)
    # the second run's limit met its last step: it ends as planned (exit 0 above: no third run)
    assert f"stop requested at the last step {total} (time limit)" in text[after:], text[after:][-2000:]
