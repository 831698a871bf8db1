"""SLURM scripts: syntax, and the torchrun command line they launch, with stand-ins for srun and
scontrol on PATH (test doubles of the scheduler only: they record their arguments)."""
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE_SCRIPTS = {"slurm/ppo_qwen7b.sh": "configs/qwen2_7b.yaml", "slurm/ppo_qwen3_8b.sh": "configs/qwen3_8b.yaml",
                "slurm/ppo_qwen3_30b_a3b.sh": "configs/qwen3_30b_a3b.yaml"}
"""Each size's template -> the config it launches."""
SCRIPTS = ["slurm/ppo.sh", *SIZE_SCRIPTS]

FAKE_SRUN = """#!/bin/sh
printf '%s\\0' "$@" > "$FAKE_LOG/srun.argv"
for k in OMP_NUM_THREADS PET_SIGNALS_TO_HANDLE TORCH_ELASTIC_SHUTDOWN_TIMEOUT SRUN_CPUS_PER_TASK SLURM_JOB_END_TIME; do
    eval "echo $k=\\${$k:-}"
done > "$FAKE_LOG/srun.env"
[ -n "${FAKE_SRUN_TOUCH:-}" ] && touch "$FAKE_SRUN_TOUCH"
if [ -n "${FAKE_SRUN_WAIT_FOR:-}" ]; then while [ ! -e "$FAKE_SRUN_WAIT_FOR" ]; do sleep 0.1; done; fi
echo "srun $*"
exit ${FAKE_SRUN_EXIT:-0}
"""
FAKE_SQUEUE = """#!/bin/sh
echo "${FAKE_END:-}"
"""
FAKE_SCONTROL = """#!/bin/sh
printf '%s\\0' "$@" > "$FAKE_LOG/scontrol.argv"
printf 'gpu-node-07\\ngpu-node-08\\n'
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax_and_sbatch_headers(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, script)], check=True)
    with open(os.path.join(ROOT, script)) as f:
        headers = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", f.read(), re.M))
    assert headers["ntasks-per-node"] == "1" and headers["output"] == "logs/%x-%j.out"
    assert {"job-name", "nodes", "gpus-per-node", "cpus-per-task", "time"} <= set(headers)


def _read_argv(path):
    with open(path) as f:
        return f.read().split("\0")[:-1]


def _run(tmp_path, script, args, **env_extra):
    """Run `script` from a copy of slurm/ in a fake submit folder; returns (srun argv, scontrol argv, stdout)."""
    proc, log = _start(tmp_path, script, args, **env_extra)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "repo" / "logs").is_dir() and (tmp_path / "repo" / "runs" / "4242").is_dir()
    return _read_argv(log / "srun.argv"), _read_argv(log / "scontrol.argv"), out


def _start(tmp_path, script, args, **env_extra):
    """The batch shell of `script`, started in a fake submit folder; returns (process, log folder)."""
    repo, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "log"
    shutil.copytree(os.path.join(ROOT, "slurm"), repo / "slurm")
    for d in (bin_dir, log):
        d.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "PET_")) and k not in
           ("GPUS_PER_NODE", "OMP_NUM_THREADS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_SUBMIT_DIR=str(repo), SLURM_GPUS_ON_NODE="8")
    env.update(env_extra)
    proc = subprocess.Popen(["bash", str(repo / script), *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, log


def _torchrun(srun_argv):
    assert "torchrun" in srun_argv, srun_argv
    return srun_argv[srun_argv.index("torchrun"):]


def test_generic_script_launch_line(tmp_path):
    srun, scontrol, out = _run(tmp_path, "slurm/ppo.sh",
                               ["configs/qwen2_72b.yaml", "actor.optim.lr=2e-6", "trainer.log_dir=runs/mine"])
    assert scontrol == ["show", "hostnames", "gpu-node-[07-08]"]
    assert _torchrun(srun) == [
        "torchrun", "--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu-node-07:29500", "--rdzv_id=4242",
        "scripts/train_ppo.py", "--config", "configs/qwen2_72b.yaml",
        "trainer.log_dir=runs/4242", "trainer.default_local_dir=checkpoints/4242",
        "actor.optim.lr=2e-6", "trainer.log_dir=runs/mine"]  # user overrides last: they win
    assert "srun --kill-on-bad-exit=1 torchrun" in out


def test_gpus_per_node_and_port_knobs(tmp_path):
    srun, _, _ = _run(tmp_path, "slurm/ppo.sh", ["configs/qwen2_0.5b.yaml"], GPUS_PER_NODE="4", RDZV_PORT="31000")
    line = _torchrun(srun)
    assert "--nproc_per_node=4" in line and "--rdzv_endpoint=gpu-node-07:31000" in line


@pytest.mark.parametrize("script", sorted(SIZE_SCRIPTS))
def test_size_script_uses_its_config_and_node_count(tmp_path, script):
    srun, _, _ = _run(tmp_path, script, ["critic.optim.lr=2e-5"])
    line = _torchrun(srun)
    assert line[line.index("--config") + 1] == SIZE_SCRIPTS[script]
    assert line[-1] == "critic.optim.lr=2e-5" and "--nnodes=2" in line  # SLURM_NNODES of the fake job
    with open(os.path.join(ROOT, script)) as f:
        sbatch_nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", f.read(), re.M).group(1))
    with open(os.path.join(ROOT, SIZE_SCRIPTS[script])) as f:
        config_nodes = int(re.search(r"^# launch: nodes=(\d+)$", f.read(), re.M).group(1))
    assert sbatch_nodes == config_nodes


def test_size_templates_and_their_configs_exist():
    assert all(os.path.isfile(os.path.join(ROOT, path)) for path in [*SIZE_SCRIPTS, *SIZE_SCRIPTS.values()])


def test_missing_config_argument_fails_with_usage(tmp_path):
    env = dict(os.environ, SLURM_JOB_NODELIST="n1", SLURM_JOB_ID="1", SLURM_NNODES="1")
    proc = subprocess.run(["bash", os.path.join(ROOT, "slurm", "ppo.sh")], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=30)
    assert proc.returncode != 0 and "usage: sbatch" in proc.stderr


def test_split_placement_on_whole_nodes(tmp_path):
    """ROLLOUT_NODES=1 on 2 nodes of 8 GPUs: the last 8 ranks (the second node) generate; overrides still win."""
    srun, _, _ = _run(tmp_path, "slurm/ppo.sh", ["configs/qwen2_7b.yaml", "async_training.staleness_threshold=1"],
                      ROLLOUT_NODES="1")
    line = _torchrun(srun)
    assert line[-3:] == ["placement.mode=split", "placement.rollout_world_size=8",
                         "async_training.staleness_threshold=1"]


def test_split_placement_needs_a_training_node(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_NODELIST="n1", SLURM_JOB_ID="1", SLURM_NNODES="1", ROLLOUT_NODES="1",
               PATH=f"{tmp_path}:{env['PATH']}")
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho n1\n")
    (tmp_path / "scontrol").chmod(0o755)
    proc = subprocess.run(["bash", os.path.join(ROOT, "slurm", "ppo.sh"), "configs/qwen2_7b.yaml"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert proc.returncode == 2 and "ROLLOUT_NODES=1 leaves no node to train" in proc.stderr


def test_a_run_that_saved_and_stopped_is_requeued(tmp_path):
    """Exit 75 (saved on a preemption signal or the time limit): the job requeues itself under its own id."""
    srun, scontrol, out = _run(tmp_path, "slurm/ppo.sh", ["configs/qwen2_7b.yaml"], FAKE_SRUN_EXIT="75")
    assert scontrol == ["requeue", "4242"] and "requeueing" in out


@pytest.mark.parametrize("script", SCRIPTS)
def test_preemption_headers(script):
    with open(os.path.join(ROOT, script)) as f:
        text = f.read()
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --open-mode=append" in text  # the requeued run's lines follow the first run's


def _srun_env(tmp_path) -> dict:
    with open(tmp_path / "log" / "srun.env") as f:
        return dict(line.rstrip("\n").split("=", 1) for line in f)


def test_cpu_only_allocation_runs_a_process_per_cpu(tmp_path):
    """sbatch --gpus-per-node=0 --cpus-per-task=4: no GPUs on the node, 4 ranks of 1 thread; srun gets the
    task's CPUs (srun of SLURM 22.05 on does not inherit them), torchrun passes USR1 on to the ranks."""
    srun, _, out = _run(tmp_path, "slurm/ppo.sh", ["configs/tiny_cpu.yaml"], SLURM_GPUS_ON_NODE="",
                        SLURM_GPUS_PER_NODE="0", SLURM_CPUS_PER_TASK="4", SLURM_CPUS_ON_NODE="4")
    assert "--nproc_per_node=4" in _torchrun(srun) and "x 4 CPU processes" in out
    env = _srun_env(tmp_path)
    assert env["OMP_NUM_THREADS"] == "1" and env["SRUN_CPUS_PER_TASK"] == "4"
    assert "SIGUSR1" in env["PET_SIGNALS_TO_HANDLE"].split(",") and int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) > 30


def test_gpu_count_from_a_typed_request_and_threads_per_gpu(tmp_path):
    srun, _, out = _run(tmp_path, "slurm/ppo.sh", ["configs/tiny_cpu.yaml"], SLURM_GPUS_ON_NODE="",
                        SLURM_GPUS_PER_NODE="a100:4", SLURM_CPUS_PER_TASK="32")
    assert "--nproc_per_node=4" in _torchrun(srun) and "x 4 GPUs" in out
    assert _srun_env(tmp_path)["OMP_NUM_THREADS"] == "8"


def test_job_end_time_from_squeue_when_slurm_does_not_export_it(tmp_path):
    """SLURM 22.05 exports no SLURM_JOB_END_TIME; trainer.stop_margin_s needs it."""
    _run(tmp_path, "slurm/ppo.sh", ["configs/tiny_cpu.yaml"], FAKE_END="2030-01-02T03:04:05", TZ="UTC")
    assert _srun_env(tmp_path)["SLURM_JOB_END_TIME"] == "1893553445"
    _run(tmp_path / "unlimited", "slurm/ppo.sh", ["configs/tiny_cpu.yaml"], FAKE_END="NONE")
    assert _srun_env(tmp_path / "unlimited")["SLURM_JOB_END_TIME"] == ""


def test_a_run_that_saved_is_requeued_whatever_torchrun_returns(tmp_path):
    """torchrun exits 1 when a rank exits 75: the STOPPED file the run leaves is what says it saved."""
    stopped = tmp_path / "repo" / "checkpoints" / "4242" / "STOPPED"
    _, scontrol, out = _run(tmp_path, "slurm/ppo.sh", ["configs/qwen2_7b.yaml"], FAKE_SRUN_EXIT="1",
                            FAKE_SRUN_TOUCH=str(stopped))
    assert scontrol == ["requeue", "4242"] and "requeueing" in out


def test_a_run_that_finished_is_not_requeued_by_a_late_signal(tmp_path):
    """A signal while the run finished (its export, the writer's close) touched STOP, but the run exited 0 with
    every step done: requeueing it would train again from its last checkpoint (from scratch without one)."""
    stop = tmp_path / "repo" / "checkpoints" / "4242" / "STOP"
    _, scontrol, out = _run(tmp_path, "slurm/ppo.sh", ["configs/qwen2_7b.yaml"], FAKE_SRUN_TOUCH=str(stop))
    assert scontrol == ["show", "hostnames", "gpu-node-[07-08]"] and "requeueing" not in out
    _, scontrol, out = _run(tmp_path / "failed", "slurm/ppo.sh", ["configs/qwen2_7b.yaml"], FAKE_SRUN_EXIT="1",
                            FAKE_SRUN_TOUCH=str(tmp_path / "failed" / "repo" / "checkpoints" / "4242" / "STOP"))
    assert scontrol == ["requeue", "4242"] and "requeueing" in out  # stopped before it could save: resumes


def test_max_runtime_counts_from_the_process_start():
    """Set-up, checkpoint load and the first validation count against trainer.max_runtime (they did not: a
    big model's set-up pushed the stop past the job's end)."""
    import psutil

    from hybridrl.trainer.preemption import deadline

    assert deadline("00:01:00", 300, {}) == pytest.approx(psutil.Process().create_time() + 60, abs=1e-3)
    assert deadline("00:01:00", 300, {"SLURM_JOB_END_TIME": "1000"}) == 700.0


def test_what_stopped_the_previous_run_does_not_requeue_the_next(tmp_path):
    """STOP and STOPPED of a requeued job's earlier run are removed before the run starts."""
    ckpt = tmp_path / "repo" / "checkpoints" / "4242"
    ckpt.mkdir(parents=True)
    (ckpt / "STOP").touch()
    (ckpt / "STOPPED").write_text("step 3 (SIGUSR1)\n")
    _, scontrol, out = _run(tmp_path, "slurm/ppo.sh", ["configs/qwen2_7b.yaml"])
    assert scontrol == ["show", "hostnames", "gpu-node-[07-08]"] and "requeueing" not in out
    assert not (ckpt / "STOP").exists() and not (ckpt / "STOPPED").exists()


def test_signal_touches_the_stop_file_of_the_checkpoint_folder_in_use(tmp_path):
    """USR1 to the batch shell (SLURM's --signal=B:USR1@300) touches STOP where the run looks for it, also
    when trainer.default_local_dir is given on the command line; the job then requeues."""
    mine = tmp_path / "mine"
    proc, log = _start(tmp_path, "slurm/ppo.sh", ["configs/qwen2_7b.yaml", f"trainer.default_local_dir={mine}"],
                       FAKE_SRUN_WAIT_FOR=str(mine / "STOP"), FAKE_SRUN_EXIT="1")
    try:
        deadline = time.monotonic() + 20
        while not (log / "srun.argv").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stop requested" in out and "requeueing" in out and _read_argv(log / "scontrol.argv") == ["requeue", "4242"]
