"""Checkpoint folders: atomic publication, keep-last-K per role, pointer, partial folders never taken; a run
SIGKILLed in the middle of a save; every bad resume input ends in one `error:` line of train_ppo.py; a save
into a folder that cannot take it ends the run with one `error:` line and the last checkpoint intact."""
import glob
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridrl.checkpoint import (CheckpointError, CheckpointManager, choose_checkpoint, read_meta, rng_state,
                                 set_rng_state)
from hybridrl.checkpoint.folders import POINTER, check_step_folder
from test_trainer import ROOT, TINY, _overrides

SCRIPT = os.path.join(ROOT, "scripts", "train_ppo.py")


def _publish(ckpt, step, roles=("actor",)):
    tmp = ckpt.prepare(step)
    for role in roles:
        os.makedirs(os.path.join(tmp, role))
        open(os.path.join(tmp, role, "shard"), "w").write(str(step))
    return ckpt.publish(step, {"data": {"batch_index": step}, "roles": list(roles)})


def _parts(root):
    """{step: sorted roles on disk} of every global_step_* folder under root, complete or not."""
    return {int(n.split("_")[-1]): sorted(os.listdir(root / n)) for n in os.listdir(root) if n.startswith("global_step_")
            and not n.endswith(".tmp")}


def test_publish_prune_pointer_and_partial_folders(tmp_path):
    ckpt = CheckpointManager(str(tmp_path), keep=2)
    for step in (2, 4, 6):
        _publish(ckpt, step)
    assert sorted(ckpt.complete_steps()) == [4, 6] and ckpt.latest().endswith("global_step_6")
    assert read_meta(ckpt.latest()) == {"data": {"batch_index": 6}, "roles": ["actor"], "step": 6}
    # a killed save's folder, a step folder without meta.json and a pointer past them are never taken
    os.makedirs(tmp_path / "global_step_8.tmp")
    os.makedirs(tmp_path / "global_step_9")
    (tmp_path / POINTER).write_text("9")
    assert ckpt.latest().endswith("global_step_6") and 9 not in ckpt.complete_steps()
    _publish(ckpt, 6)  # re-saving a step replaces it whole; leftovers of killed saves go
    assert not os.path.exists(tmp_path / "global_step_8.tmp") and (tmp_path / POINTER).read_text() == "6"
    assert choose_checkpoint(ckpt, "disable", True) is None
    assert choose_checkpoint(ckpt, "auto", True).endswith("global_step_6")  # global_step_9 skipped: no meta.json
    assert choose_checkpoint(ckpt, str(tmp_path / "global_step_4"), True).endswith("global_step_4")


def test_rotation_keeps_an_older_checkpoint_while_a_newer_ones_shared_files_are_damaged(tmp_path):
    """keep=2: a step whose rng/ (a file every resume reads beside the roles' parts) is truncated does not count,
    so the next save deletes nothing a resume still needs (it deleted step 40, then 60 broke: nothing intact)."""
    from hybridrl.checkpoint.integrity import FILES, list_files, record

    ckpt = CheckpointManager(str(tmp_path), keep=2)

    def publish(step):
        tmp = ckpt.prepare(step)
        for part, name in (("actor", "shard"), ("rng", "0.pt")):
            os.makedirs(os.path.join(tmp, part))
            open(os.path.join(tmp, part, name), "w").write(f"{part} {step}")
        ckpt.publish(step, {"roles": ["actor"], FILES: record(tmp, list_files(tmp))})

    publish(40)
    publish(50)
    open(tmp_path / "global_step_50" / "rng" / "0.pt", "w").close()  # truncated
    publish(60)
    assert sorted(ckpt.complete_steps()) == [40, 50, 60]  # 40 and 60 are the two a resume can use
    assert choose_checkpoint(ckpt, "auto", True).endswith("global_step_60")


def test_a_requeued_job_resumes_past_the_checkpoint_it_was_started_from(tmp_path, monkeypatch):
    """sbatch ... trainer.resume_mode=<elsewhere>/global_step_4: the first run starts there; a requeue repeats the
    command line, so it must take the job's own newer saves (it restarted from step 4 at every requeue)."""
    elsewhere, own = CheckpointManager(str(tmp_path / "elsewhere")), CheckpointManager(str(tmp_path / "own"))
    named = _publish(elsewhere, 4)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert choose_checkpoint(own, named, True) == named  # the job's first run
    for step in (6, 8):
        _publish(own, step)
    assert choose_checkpoint(own, named, True) == named  # not requeued: the path as given (a rollback)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert choose_checkpoint(own, named, True).endswith("own/global_step_8")
    os.remove(tmp_path / "own" / "global_step_8" / "meta.json")  # damaged: the next newer one
    assert choose_checkpoint(own, named, True).endswith("own/global_step_6")


def test_prune_counts_actor_and_critic_apart(tmp_path):
    """verl's max_actor_ckpt_to_keep / max_critic_ckpt_to_keep: each role's oldest complete parts go, a step
    folder goes when no part is left, the newest stays, partial and foreign folders are never touched."""
    ckpt = CheckpointManager(str(tmp_path), keep={"actor": 2, "critic": 1})
    for step in (1, 2, 3, 4):
        _publish(ckpt, step, ("actor", "critic"))
    parts = _parts(tmp_path)
    assert parts == {3: ["actor", "meta.json"], 4: ["actor", "critic", "meta.json"]}, parts
    # a save being written (no meta.json yet, `.tmp`), a step folder without meta.json: never counted, never deleted
    os.makedirs(tmp_path / "global_step_9.tmp" / "actor")
    os.makedirs(tmp_path / "global_step_0" / "actor")
    ckpt.prune(newest=4)
    assert os.listdir(tmp_path / "global_step_9.tmp") == ["actor"] and os.listdir(tmp_path / "global_step_0") == ["actor"]
    assert _parts(tmp_path)[3] == ["actor", "meta.json"] and sorted(ckpt.complete_steps()) == [3, 4]
    # the checkpoint just written stays even when its step is lower (a run resumed from an older one)
    _publish(ckpt, 2, ("actor", "critic"))
    assert sorted(ckpt.complete_steps()) == [2, 4] and _parts(tmp_path)[2] == ["actor", "critic", "meta.json"]
    assert _parts(tmp_path)[4] == ["actor", "meta.json"]
    # a deletion killed after the rename leaves a `.tmp` part, swept by the next prune
    os.makedirs(tmp_path / "global_step_4" / "critic.del.tmp")
    _publish(ckpt, 5, ("actor", "critic"))
    assert _parts(tmp_path) == {0: ["actor"], 4: ["actor", "meta.json"], 5: ["actor", "critic", "meta.json"]}


def test_keep_all_by_default_and_one_limit_for_every_role(tmp_path):
    for keep, want in ((None, [1, 2, 3]), ({"actor": 0, "critic": None}, [1, 2, 3]), (1, [3])):
        root = tmp_path / str(keep)
        ckpt = CheckpointManager(str(root), keep)
        for step in (1, 2, 3):
            _publish(ckpt, step, ("actor", "critic"))
        assert sorted(ckpt.complete_steps()) == want and sorted(os.listdir(root / "global_step_3")) == [
            "actor", "critic", "meta.json"], keep


def test_pruned_part_names_the_setting(tmp_path):
    from hybridrl.checkpoint import load_checkpoint
    from hybridrl.checkpoint.writer import RUN_KEYS

    ckpt = CheckpointManager(str(tmp_path), keep={"critic": 1})
    for step in (1, 2):
        tmp = ckpt.prepare(step)
        for role in ("actor", "critic"):
            os.makedirs(os.path.join(tmp, role))
        ckpt.publish(step, {**{k: 0 for k in RUN_KEYS["rl"]}, "roles": ["actor", "critic"], "layout": {}})
    with pytest.raises(CheckpointError, match="global_step_1 no longer holds its critic state.*max_critic_ckpt_to_keep"):
        load_checkpoint(ckpt.step_dir(1), {"critic": None}, {})


def test_trainer_keys_validated():
    from hybridrl.config import ConfigError, TrainerConfig
    from hybridrl.config.io import load_config

    assert TrainerConfig().max_actor_ckpt_to_keep is None and TrainerConfig().max_critic_ckpt_to_keep is None
    with pytest.raises(ConfigError, match=r"trainer.max_critic_ckpt_to_keep=-1: pass K >= 1.*or null \(or 0\)"):
        TrainerConfig(max_critic_ckpt_to_keep=-1)
    with pytest.raises(ConfigError, match="'trainer.max_ckpt_to_keep' is now 'trainer.max_actor_ckpt_to_keep and"):
        load_config(TINY, ["trainer.max_ckpt_to_keep=2"])


def test_resume_path_messages(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "root"))
    _publish(ckpt, 3)
    os.makedirs(tmp_path / "root" / "global_step_5.tmp")
    cases = {str(tmp_path / "nope"): "no such folder; pass a global_step_* folder, or auto (the latest", str(tmp_path / "root"): "checkpoint root, not one checkpoint; "
             f"pass {tmp_path / 'root' / 'global_step_3'}", str(tmp_path / "root" / "global_step_5.tmp"):
             "not a complete checkpoint (no meta.json; an interrupted save)", str(tmp_path): "not a complete checkpoint"}
    for path, message in cases.items():
        with pytest.raises(CheckpointError, match=re.escape(message)):
            check_step_folder(path)


def test_unreadable_or_foreign_meta(tmp_path):
    from hybridrl.checkpoint import load_checkpoint
    from hybridrl.checkpoint.writer import RUN_KEYS

    ckpt = CheckpointManager(str(tmp_path))
    torn, old, grpo = (ckpt.step_dir(s) for s in (1, 2, 3))
    for path, meta in ((torn, '{"step": 1, "da'), (old, json.dumps({"step": 2, "data": {}, "kl_coef": 0.0})),
                       (grpo, json.dumps({**{k: 0 for k in RUN_KEYS["rl"]}, "roles": ["actor"], "layout": {}}))):
        os.makedirs(path)
        open(os.path.join(path, "meta.json"), "w").write(meta)
    with pytest.raises(CheckpointError, match=r"global_step_1/meta.json cannot be read \(Unterminated string"):
        load_checkpoint(torn, {}, {})
    with pytest.raises(CheckpointError, match="lacks roles, layout, hf_config.*trainer.resume_mode=disable"):
        load_checkpoint(old, {}, {})
    with pytest.raises(CheckpointError, match="has no critic state.*algorithm.adv_estimator it was saved with"):
        load_checkpoint(grpo, {"critic": None}, {})


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def _script(tmp, extra, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, "--config", TINY] + _overrides(tmp, ["trainer.logger=[console]"] + extra),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, start_new_session=True)


def _one_error(proc, *fragments):
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# Runs in the training process: SIGKILL the whole process group (the trainer and megatron's writer
# helpers, as when a node dies) once step 2's actor shards are on disk, before meta.json and the rename.
KILL_IN_SAVE = textwrap.dedent("""
    import os, signal, sys
    from hybridrl.checkpoint import writer
    real = writer.save_role
    def save_then_die(worker, folder, is_async):
        out = real(worker, folder, is_async)
        if "global_step_2.tmp" in folder:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return out
    writer.save_role = save_then_die
    from hybridrl.trainer.entry import main
    sys.exit(main(sys.argv[1:]))
""")


TB = "trainer.logger=[console,tensorboard]"


def _tensorboard_steps(log_dir, tag) -> list:
    """The steps of `tag`'s points as TensorBoard shows them: every event file of the run's folder read in order
    as one run, an earlier run's points past a resumed run's start purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = {os.path.dirname(p) for p in glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)}
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_killed_mid_save_then_auto_resume_and_bad_inputs(tmp_path):
    args = ["--config", TINY] + _overrides(tmp_path, [TB, "trainer.total_training_steps=3",
                                                      "trainer.save_freq=1", "algorithm.adv_estimator=gae"])
    proc = subprocess.run([sys.executable, "-c", KILL_IN_SAVE] + args, capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    root = tmp_path / "ckpt"
    assert os.listdir(root / "global_step_2.tmp" / "actor") and not (root / "global_step_2.tmp" / "meta.json").exists()
    assert CheckpointManager(str(root), 2).latest().endswith("global_step_1")
    resumed = _script(tmp_path, ["trainer.total_training_steps=2", "trainer.save_freq=1", "algorithm.adv_estimator=gae", TB,
                                 "trainer.val_before_train=true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {root / 'global_step_1'} at step 1" in resumed.stdout
    assert sorted(CheckpointManager(str(root), 2).complete_steps()) == [1, 2]
    assert not (root / "global_step_2.tmp").exists() and read_meta(str(root / "global_step_2"))["roles"] == ["actor", "critic"]
    # TensorBoard reads the folder as one run: the killed run's step 2 is dropped, the resumed run's stands alone
    assert _tensorboard_steps(tmp_path / "tb", "actor/pg_loss") == [1, 2]
    # val_before_train validates a resumed run too, at the step it goes on from (as verl)
    assert _tensorboard_steps(tmp_path / "tb", "val-core/synthetic/arith/acc/mean@1") == [1]
    # a bad resume input through the script (a checkpoint this model cannot load): one `error:` line naming
    # the problem and the fix; test_resume_path_messages has the path checks made before any model is built
    _one_error(_script(tmp_path / "c", [f"trainer.resume_mode={root / 'global_step_2'}", "model.intermediate_size=96",
                                        "algorithm.adv_estimator=gae"]),
               "'decoder.layers.mlp.linear_fc1.weight' with shape [2, 256, 64], this model's is [2, 192, 64]",
               "model.* settings")
    # a shard of the newest checkpoint truncated (a node died while the file system flushed): the same command
    # skips it with one warning line and resumes from the newest intact one (issue 45; the damages one by one:
    # tests/test_checkpoint_damage.py)
    os.truncate(root / "global_step_2" / "actor" / "__0_1.distcp", 1000)
    skipped = _script(tmp_path, ["trainer.total_training_steps=2", "trainer.save_freq=1", "algorithm.adv_estimator=gae"])
    assert skipped.returncode == 0 and "Traceback" not in skipped.stderr, skipped.stderr[-3000:]
    warnings = [line for line in skipped.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{root / 'global_step_2'} (actor/__0_1.distcp (model and optimizer shards) is " \
        "1000 bytes" in warnings[0], warnings
    assert f"resumed from {root / 'global_step_1'} at step 1" in skipped.stdout


KEEP = ["trainer.save_freq=1", "algorithm.adv_estimator=gae", "trainer.max_actor_ckpt_to_keep=1",
        "trainer.max_critic_ckpt_to_keep=2"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A PPO run (actor + critic) that saved steps 1 and 2, keeping 1 actor and 2 critics."""
    tmp = tmp_path_factory.mktemp("saved")
    proc = _script(tmp, ["trainer.total_training_steps=2"] + KEEP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def _parts_of_run(tmp):
    """{folder: its entries} of the published checkpoints of a run."""
    root = tmp / "ckpt"
    return {n: sorted(os.listdir(root / n)) for n in os.listdir(root) if n.startswith("global_step_")
            and not n.endswith(".tmp")}


SAVED = {"global_step_1": ["critic", "meta.json", "rng"], "global_step_2": ["actor", "critic", "meta.json", "rng"]}


def _small_files():
    """In the training process: files may grow to 100 kB only (RLIMIT_FSIZE; a write past it fails with
    EFBIG instead of killing the process), so writing the first shard of a checkpoint fails midway, as on
    a full disk; the data and model files of the run are already there and only read."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))


def _failed_save(tmp, extra=(), preexec_fn=None, prefix=()):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*prefix, sys.executable, SCRIPT, "--config", TINY] + _overrides(tmp, [
        "trainer.logger=[console]", "trainer.total_training_steps=3"] + KEEP + list(extra)), capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env, start_new_session=True, preexec_fn=preexec_fn)
    _one_error(proc, "could not write the checkpoint of step 3", "nothing older was deleted",
               f"the last complete checkpoint is {tmp / 'ckpt' / 'global_step_2'}")
    assert "resumed from" in proc.stdout and "step:3" in proc.stdout  # it trained step 3, then failed saving it
    assert _parts_of_run(tmp) == SAVED
    return proc


def _obeying_modes(read_only_dir):
    """A command prefix under which a process cannot write into `read_only_dir` (chmod 0o555): none for a
    normal user; for root, setpriv without the capability to override file modes; None when neither works."""
    for prefix in ([], ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]):
        try:
            if subprocess.run(prefix + ["test", "-w", str(read_only_dir)], capture_output=True).returncode != 0:
                return prefix
        except OSError:
            pass
    return None


@pytest.mark.slow
def test_save_into_a_full_disk_ends_the_run_and_keeps_the_last_checkpoint(saved_run, tmp_path):
    assert _parts_of_run(saved_run) == SAVED  # the real trainer's pruning: actor of step 1 gone, its critic kept
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    # a full disk, with the shards written in the training process and by megatron's background writer
    for extra in ([], ["trainer.async_save=true"]):
        _failed_save(tmp_path, extra, preexec_fn=_small_files)
    # the previous checkpoint is intact: the same command resumes from it, saves step 3, and prunes
    shutil.rmtree(tmp_path / "ckpt" / "global_step_3.tmp", ignore_errors=True)
    resumed = _script(tmp_path, ["trainer.total_training_steps=3"] + KEEP)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / 'global_step_2'} at step 2" in resumed.stdout
    assert _parts_of_run(tmp_path) == {"global_step_2": ["critic", "meta.json", "rng"],
                                       "global_step_3": ["actor", "critic", "meta.json", "rng"]}


def _split_per_rank(tmp, extra):
    """train_ppo.py in split placement (1 trainer + 1 rollout rank), one process per rank as srun starts them:
    [(exit code, stderr)] of the trainer and the rollout rank."""
    from dist_helper import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    cmd = [sys.executable, SCRIPT, "--config", TINY] + _overrides(tmp, ["trainer.logger=[console]", "placement.mode=split",
                                                                       "placement.rollout_world_size=1"] + extra)
    logs = [open(tmp / f"rank{r}.err", "w+") for r in range(2)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logs[r], cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(code, (tmp / f"rank{r}.err").read_text()) for r, code in enumerate(codes)]


@pytest.mark.slow
def test_no_intact_checkpoint_in_split_placement_is_one_error_line(saved_run, tmp_path):
    """The run's newest checkpoint has a truncated shard and the one before it no actor (the keep rule took it):
    resumed in split placement, trainer.resume_mode=auto ends in one `error:` line naming both, exit 2, the
    rollout rank let go, nothing deleted (colocated, the same function chooses: tests/test_checkpoint_damage.py)."""
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    root = tmp_path / "ckpt"
    os.truncate(root / "global_step_2" / "critic" / "__0_0.distcp", 10)
    (trainer, trainer_err), (rollout, _) = _split_per_rank(tmp_path, ["trainer.total_training_steps=3"] + KEEP)
    _one_error(subprocess.CompletedProcess([], trainer, "", trainer_err),
               f"no intact checkpoint under trainer.default_local_dir={root} to resume from: global_step_2: "
               "critic/__0_0.distcp (model and optimizer shards) is 10 bytes",
               "global_step_1: its actor part is gone (deleted by trainer.max_actor_ckpt_to_keep, or lost)")
    assert rollout == 0 and _parts_of_run(tmp_path) == SAVED


@pytest.mark.slow
def test_save_into_a_read_only_or_blocked_folder(saved_run, tmp_path):
    """The checkpoint root is read-only; where this process can write into it anyway (root without setpriv),
    the folder the new checkpoint would go into is taken by a file instead (the same failure in `prepare`)."""
    shutil.copytree(saved_run, tmp_path, dirs_exist_ok=True)
    os.chmod(tmp_path / "ckpt", 0o555)
    try:
        prefix = _obeying_modes(tmp_path / "ckpt")
        if prefix is not None:
            proc = _failed_save(tmp_path, prefix=prefix)
    finally:
        os.chmod(tmp_path / "ckpt", 0o755)
    if prefix is None:
        (tmp_path / "ckpt" / "global_step_3.tmp").write_text("in the way")
        proc = _failed_save(tmp_path)
        assert "a file stands where" in proc.stderr, proc.stderr[-3000:]
        return
    assert f"Permission denied: {tmp_path / 'ckpt' / 'global_step_3.tmp'}; make it writable" in proc.stderr



def _save_failing_on_one_rank(root, where):
    """Rank 0 cannot create the folder (`root` is a file), or rank 1 cannot write its RNG file (a full disk):
    what each rank's CheckpointWriter.save raises."""
    import errno

    import torch.distributed as dist

    from hybridrl.checkpoint import CheckpointWriter
    from hybridrl.checkpoint import writer

    if where == "rng" and dist.get_rank() == 1:
        def full(obj, path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        writer._save_file = full
    try:
        CheckpointWriter(CheckpointManager(root)).save(3, {}, {"data": {}})
    except CheckpointError as err:
        return str(err)
    return "saved"


@pytest.mark.distributed
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path):
    """Both ranks raise the same error (rather than one waiting for the other in a collective)."""
    from dist_helper import run_distributed

    (tmp_path / "a_file").write_text("not a folder")
    for root, where, cause in ((tmp_path / "a_file", "prepare", f"File exists: {tmp_path / 'a_file'}; a file stands where"),
                               (tmp_path / "ckpt", "rng", f"No space left on device: {tmp_path / 'ckpt' / 'global_step_3.tmp'}; free space")):
        errors = run_distributed(_save_failing_on_one_rank, 2, str(root), where)
        assert errors[0] == errors[1] and cause in errors[0] and "the last complete checkpoint is none yet" in errors[0]
    assert CheckpointManager(str(tmp_path / "ckpt")).complete_steps() == []


def _sleep(seconds):
    import time

    time.sleep(seconds)


def _raise_write_failure():
    from torch.distributed.checkpoint.api import CheckpointException

    raise CheckpointException("write", {0: (OSError(28, "No space left on device"), "")})


def _abandoned_async_save(root):
    """Rank body: an async save of two roles (one writer process each, as megatron-core's AsyncCallsQueue
    starts them) whose first role fails at once while the second is still writing; the pids of the writer
    processes still running once the failure is reported."""
    import psutil
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from hybridrl.checkpoint.writer import CheckpointWriter
    from hybridrl.parallel.distributed import init_model_parallel

    init_model_parallel(1, 1)
    writer = CheckpointWriter(CheckpointManager(root), async_save=True)
    writer.queue.schedule_async_request(AsyncRequest(_sleep, (0,), [_raise_write_failure]))
    writer.queue.schedule_async_request(AsyncRequest(_sleep, (4,), []))
    writer.pending = 7
    with pytest.raises(CheckpointError, match="could not write the checkpoint of step 7"):
        writer.finalize()
    return [p.pid for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]


def test_a_failed_async_save_leaves_no_writer_running(tmp_path):
    """The other roles' writers are waited for before the error goes up: one that outlived the run wrote into
    the results queue of a manager already stopped and printed a traceback under the run's one error line."""
    from dist_helper import run_distributed

    assert run_distributed(_abandoned_async_save, 1, str(tmp_path))[0] == []


def test_rng_streams_are_restored_at_the_same_layout_only():
    """Context and expert parallel sizes count: at CP 2 rank 1 is the second half of rank 0's rows, at CP 1 and
    DP 2 it is another replica, so its RNG streams are not rank 1's there. A checkpoint from before CP and EP
    were recorded is CP 1, EP 1."""
    from types import SimpleNamespace

    from hybridrl.checkpoint.writer import layout_of, same_layout

    cp2 = layout_of(SimpleNamespace(tp=1, pp=1, dp=2, cp=2, ep=1))
    dp2 = layout_of(SimpleNamespace(tp=1, pp=1, dp=2, cp=1, ep=1))
    ep2 = layout_of(SimpleNamespace(tp=1, pp=1, dp=2, cp=1, ep=2))
    assert not same_layout(cp2, dp2) and not same_layout(ep2, dp2) and same_layout(cp2, dict(cp2))
    assert same_layout({"tp": 1, "pp": 1, "dp": 2}, dp2) and not same_layout({"tp": 1, "pp": 1, "dp": 2}, cp2)
