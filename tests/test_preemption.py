"""Stopping on purpose: SIGTERM / SIGUSR1 / SIGINT, the stop file and trainer.max_runtime save a checkpoint at
the next step boundary, print `saved on signal at step K` and exit 75; the same command then resumes."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test_trainer import ROOT, TINY, _overrides, assert_resumed

LONG = ["trainer.total_training_steps=100000", "trainer.log_freq=1"]


def ends_within(procs, seconds: float) -> list:
    """The exit codes of `procs`, which must all end within `seconds` from now (else an AssertionError
    saying so: Popen.wait's own timeout would stop the test before a looser bound was ever checked)."""
    deadline = time.monotonic() + seconds
    try:
        return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds:g} s later") from None


def _start(tmp, extra, nproc=1):
    from dist_helper import free_port

    script = [os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY] + _overrides(tmp, LONG + extra)
    if nproc > 1:
        script = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"] + script
    os.makedirs(tmp, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    return subprocess.Popen([sys.executable] + script, stdout=open(tmp / "out.log", "w"), stderr=subprocess.STDOUT,
                            cwd=ROOT, env=env, start_new_session=True)


def _wait_for(path, pattern, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text())
        if m:
            return m
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} never appeared: {path.read_text()[-2000:]}")


def _stopped(run, tmp):
    try:
        code = run.wait(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    out = (tmp / "out.log").read_text()
    m = re.search(r"saved on signal at step (\d+) \(([^)]*)\)", out)
    assert m, out[-3000:]
    step = int(m.group(1))
    assert (tmp / "ckpt" / f"global_step_{step}" / "meta.json").exists()
    return code, step, m.group(2), out


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_signal_saves_and_the_same_command_resumes(tmp_path, sig):
    """The signal goes to the whole process group, as SLURM's pre-emption and torchrun's forwarding send it,
    after a save (save_freq 2): megatron's write helpers, started by that save, must outlive it (they died,
    and the save on signal failed with a broken pipe)."""
    run = _start(tmp_path, ["trainer.save_freq=2"])
    _wait_for(tmp_path / "out.log", r"step:3 ")
    os.killpg(run.pid, getattr(signal, sig))
    code, step, reason, _ = _stopped(run, tmp_path)
    assert code == 75 and reason == sig and step >= 3
    if sig != "SIGTERM":  # the resume is the same whatever stopped the run: checked once
        return
    resumed = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
                             + _overrides(tmp_path, [f"trainer.total_training_steps={step + 1}",
                                                     f"trainer.log_dir={tmp_path}/resumed/tb"]),
                             capture_output=True, text=True, cwd=ROOT, timeout=180,
                             env={k: v for k, v in os.environ.items() if k != "MASTER_PORT"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_resumed(resumed.stdout + resumed.stderr, tmp_path / "resumed", step, step + 1)


@pytest.mark.slow
def test_stop_file_and_time_limit(tmp_path):
    run = _start(tmp_path / "file", [])
    _wait_for(tmp_path / "file" / "out.log", r"step:2 ")
    (tmp_path / "file" / "ckpt" / "STOP").touch()
    code, _, reason, _ = _stopped(run, tmp_path / "file")
    assert code == 75 and reason.startswith("stop file")
    run = _start(tmp_path / "limit", ["trainer.max_runtime=00:00:01"])
    code, _, reason, _ = _stopped(run, tmp_path / "limit")
    assert code == 75 and reason == "time limit"
    # a limit (or a stop file) met at the last step ends the run as planned: exit 0, no requeue asked for
    (tmp_path / "last" / "ckpt").mkdir(parents=True)
    (tmp_path / "last" / "ckpt" / "STOP").touch()
    run = _start(tmp_path / "last", ["trainer.max_runtime=00:00:01", "trainer.total_training_steps=1"])
    assert ends_within([run], 120) == [0]
    out = (tmp_path / "last" / "out.log").read_text()
    assert "saved on signal" not in out and "stop requested at the last step 1" in out, out[-2000:]
    assert not (tmp_path / "last" / "ckpt" / "STOPPED").exists() and not (tmp_path / "last" / "ckpt" / "STOP").exists()


@pytest.mark.slow
def test_split_run_saves_on_signal(tmp_path):
    """torchrun passes SIGTERM to every rank: the rollout rank waits to be told, the trainer saves (with the
    batch in flight at staleness 1) and both end; nothing is left running. torchrun itself exits 1 (the ranks
    75), so STOPPED in the checkpoint folder is what tells slurm/ppo.sh to requeue; the same command then
    resumes."""
    import psutil

    from test_trainer import _torchrun

    split = ["placement.mode=split", "placement.rollout_world_size=1", "async_training.staleness_threshold=1"]
    run = _start(tmp_path, split, nproc=2)
    _wait_for(tmp_path / "out.log", r"step:1 ")  # at staleness 1 the next batch is in flight from then on
    children = psutil.Process(run.pid).children(recursive=True)
    assert len([p for p in children if "train_ppo.py" in " ".join(p.cmdline())]) == 2
    os.kill(run.pid, signal.SIGTERM)
    code, step, reason, _ = _stopped(run, tmp_path)
    assert reason == "SIGTERM" and code == 1, code  # torchrun's own, on the signal it passed on
    stopped = (tmp_path / "ckpt" / "STOPPED").read_text()
    assert f"step {step}" in stopped and "SIGTERM" in stopped, stopped
    assert (tmp_path / "ckpt" / f"global_step_{step}" / "in_flight.pt").exists()
    time.sleep(1)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    resumed = _torchrun(tmp_path, 2, split + [f"trainer.total_training_steps={step + 1}",
                                              f"trainer.log_dir={tmp_path}/resumed/tb"])
    assert_resumed(resumed.stdout + resumed.stderr, tmp_path / "resumed", step, step + 1)


# both save every step; the kill waits for a save in progress (a .tmp folder) with its helper processes running
KILL_MOMENTS = {"start-up": ([], None), "sync save": (["trainer.save_freq=1"], r"step:3 "),
                "async save": (["trainer.save_freq=1", "trainer.async_save=true"], r"step:3 ")}


def _saving(ckpt) -> list:
    return [n for n in os.listdir(ckpt) if n.endswith(".tmp")] if os.path.isdir(ckpt) else []


@pytest.mark.slow
@pytest.mark.parametrize("moment", sorted(KILL_MOMENTS))
def test_kill_9_leaves_no_process_behind(tmp_path, moment):
    """kill -9 of a single-process run (while it starts, or inside a save: megatron's checkpoint writer
    processes, sync or async, running): within 5 s nothing of that run is left (children die with their
    parent), and (checked after the async save's kill) the next run on the machine starts."""
    import psutil

    extra, marker = KILL_MOMENTS[moment]
    run = _start(tmp_path, extra)
    session = os.getsid(run.pid)
    members = lambda: [p for p in psutil.process_iter(["pid"]) if _sid(p.pid) == session and p.pid != run.pid
                       and p.status() != psutil.STATUS_ZOMBIE]
    if marker is None:
        time.sleep(3)  # importing torch / megatron, building the process group
    else:
        _wait_for(tmp_path / "out.log", marker)
        deadline, writers, saving = time.monotonic() + 60, [], []
        while not (writers and saving) and time.monotonic() < deadline:
            writers, saving = members(), _saving(tmp_path / "ckpt")
        assert writers and saving, "no save seen with its writer processes running"
    os.kill(run.pid, signal.SIGKILL)
    if marker is not None:  # the save had not been published when the kill came
        assert saving and set(saving) <= set(_saving(tmp_path / "ckpt")), (saving, os.listdir(tmp_path / "ckpt"))
    run.wait()
    deadline = time.monotonic() + 5
    while members() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not members(), [p.cmdline() for p in members()]
    if moment != "async save":  # the next run's start: once, after the kill that left the most behind to clean
        return
    nxt = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
                         + _overrides(tmp_path / "next", ["trainer.total_training_steps=1"]), capture_output=True,
                         text=True, cwd=ROOT, timeout=180, env={k: v for k, v in os.environ.items() if k != "MASTER_PORT"})
    assert nxt.returncode == 0, nxt.stderr[-2000:]


def _sid(pid):
    try:
        return os.getsid(pid)
    except OSError:
        return None


@pytest.mark.slow
def test_a_hung_phase_ends_the_run_naming_rank_and_phase(tmp_path):
    """A reward function that never returns: after trainer.hang_timeout_s the run writes every thread's
    stack, prints one line naming rank and phase, and exits non-zero instead of sitting there."""
    reward = tmp_path / "slow_reward.py"
    reward.write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    time.sleep(3600)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
                          + _overrides(tmp_path, [f"reward.custom_function.path={reward}", "trainer.hang_timeout_s=4"]),
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "MASTER_PORT"})
    assert proc.returncode == 3 and time.monotonic() - start < 60
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 0 made no progress" in errors[0] and "in phase reward" in errors[0], errors
    stacks = (tmp_path / "tb" / "hang_rank0.txt").read_text()
    assert "compute_score" in stacks and "slow_reward.py" in stacks


def test_a_stop_file_older_than_the_newest_checkpoint_was_served(tmp_path):
    """A resumed run removes the stop file its predecessor saved for, but not one touched while it started
    (a pre-emption notice during a long model load used to be deleted unseen)."""
    from hybridrl.trainer.preemption import stop_file_served

    stop, ckpt = tmp_path / "STOP", tmp_path / "global_step_4"
    ckpt.mkdir()
    stop.touch()
    (ckpt / "meta.json").write_text("{}")
    os.utime(stop, (1000, 1000))
    os.utime(ckpt / "meta.json", (2000, 2000))
    assert stop_file_served(str(stop), str(ckpt))
    os.utime(stop, (3000, 3000))
    assert not stop_file_served(str(stop), str(ckpt)) and not stop_file_served(str(stop), None)


def _rank_pid(run, rank: int) -> int:
    import psutil

    for p in psutil.Process(run.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and "train_ppo.py" in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} found")


@pytest.mark.slow
def test_a_rank_killed_mid_step_is_named_by_the_others(tmp_path):
    """kill -9 of rank 1 of a colocated torchrun run while it trains: rank 0 ends within seconds with
    `rank 1 died during <phase>` (heartbeats in the job's store tell it which), and torchrun exits non-zero."""
    run = _start(tmp_path, [], nproc=2)
    try:
        _wait_for(tmp_path / "out.log", r"step:2 ")
        os.kill(_rank_pid(run, 1), signal.SIGKILL)
        (code,) = ends_within([run], 30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    out = (tmp_path / "out.log").read_text()
    assert code != 0
    assert re.search(r"^(\[rank0\]: )?error: rank 1 died during [a-z_]+ ", out, re.M), out[-3000:]  # a named phase


@pytest.mark.slow
def test_kill_9_of_torchrun_ends_its_ranks(tmp_path):
    """torchrun starts each rank in a session of its own, so a kill -9 of torchrun (or of its process group)
    reaches no rank; the ranks die with it instead of training on with nobody to report to."""
    import psutil

    run = _start(tmp_path, [], nproc=2)
    _wait_for(tmp_path / "out.log", r"step:2 ")
    ranks = [p for p in psutil.Process(run.pid).children(recursive=True) if "train_ppo.py" in " ".join(p.cmdline())]
    assert len(ranks) == 2 and all(os.getsid(p.pid) != os.getsid(run.pid) for p in ranks)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 10
    alive = lambda: [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), [p.pid for p in alive()]
