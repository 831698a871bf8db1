"""Split placement in one torchrun job: the last k ranks only generate, the others train.

Sampling is layout-independent (per-prompt seeds), so a synchronous split run must give the colocated
run's metrics and parameters; with staleness 1 every batch after the first is one version old.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from dist_helper import run_distributed
from test_trainer import ROOT, TINY, _overrides, _torchrun, _train, assert_resumed, read_scalars

SPLIT = ["placement.mode=split", "placement.rollout_world_size=1"]
PATCHED_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patched_run.py")
SAME = ("actor/", "critic/", "response_length/", "rollout/logprob_diff", "training/")


def _colocated(tmp, extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY] + _overrides(tmp, extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _resumed_leg(tmp, name):
    """Overrides that give a resumed leg a TensorBoard folder of its own (read_scalars(tmp / name))."""
    return [f"trainer.log_dir={tmp / name}/tb"]


def _spans(events, cat=None, name=None, tid=None):
    """(tid, name, start, end) of the complete events that match, in start order (seconds)."""
    return sorted((e["tid"], e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
                  if e["ph"] == "X" and cat in (None, e["cat"]) and name in (None, e["name"]) and tid in (None, e["tid"]))


def _streamed_steps(events):
    """How many trainer steps ran a forward pass on a chunk while the rollout was still generating the step's
    batch: an old_log_prob span that begins inside a rollout `gen` span and is followed, in the same step (the
    passes before its `adv`), by a wait for the next chunk (the trainer's `gen`). The whole-batch path has the
    same span names, but waits once per step, before all of its passes."""
    generating = [(s, e) for _, _, s, e in _spans(events, "rollout", "gen")]
    found, lo = 0, 0.0
    for _, _, hi, adv_end in _spans(events, "trainer", "adv", 0):
        inside = lambda name: [(s, e) for _, _, s, e in _spans(events, "trainer", name, 0) if lo <= s and e <= hi]
        waits = inside("gen")
        found += any(any(w >= p_end for w, _ in waits) and any(g <= p < g_end for g, g_end in generating)
                     for p, p_end in inside("old_log_prob"))
        lo = adv_end
    return found


def _hf_weights(folder):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _assert_same_run(a, b, steps, rel=1e-5):
    compared = 0
    for key, by_step in a.items():
        if not key.startswith(SAME):
            continue
        for step in steps:
            x, y = by_step[step], b[key][step]
            assert abs(x - y) <= rel * max(1.0, abs(x)), (key, step, x, y)
            compared += 1
    assert compared >= 20 * len(steps)


# PPO with a critic and KL in the reward, checkpoints at steps 2 and 4: run once colocated and once split (1 trainer
# + 1 rollout rank), shared by the tests below as references and as checkpoints to resume from
GAE = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "trainer.save_freq=2"]
# GRPO at a learning rate that moves the policy visibly in one step
GRPO = ["actor.optim.lr=5e-3"]


@pytest.fixture(scope="module")
def gae_colocated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gae_colocated")
    run_distributed(_train, 1, TINY, _overrides(tmp, GAE + ["trainer.total_training_steps=4",
                                                         f"trainer.export_hf_dir={tmp}/hf"]))
    return tmp


@pytest.fixture(scope="module")
def gae_split(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gae_split")
    _torchrun(tmp, 2, GAE + SPLIT + ["trainer.total_training_steps=4", f"trainer.export_hf_dir={tmp}/hf"])
    return tmp


@pytest.fixture(scope="module")
def grpo_colocated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_colocated")
    run_distributed(_train, 1, TINY, _overrides(tmp, GRPO + ["trainer.total_training_steps=3"]))
    return tmp


@pytest.fixture(scope="module")
def grpo_one_step_off(tmp_path_factory):
    """Split at staleness 1 for 6 steps, a checkpoint at step 3."""
    tmp = tmp_path_factory.mktemp("grpo_one_step_off")
    _torchrun(tmp, 2, GRPO + SPLIT + ["async_training.staleness_threshold=1", "trainer.save_freq=3",
                                      "trainer.total_training_steps=6"])
    return tmp


@pytest.mark.slow
def test_split_synchronous_equals_colocated(gae_colocated, gae_split, tmp_path):
    """PPO (critic on the actor's ranks, KL in the reward): 1 trainer + 1 rollout rank give the colocated
    run's metrics at every step and its parameters after 4 steps; so do chunks of one prompt at s = 0."""
    _torchrun(tmp_path / "streamed", 2, GAE + SPLIT + ["async_training.stream_prompts=1",
                                                       "trainer.total_training_steps=3",
                                                       f"trainer.timeline_dir={tmp_path}/timeline"])
    from hybridrl.timeline import read_trace

    # a pass per chunk (4 prompts a step; the whole-batch path runs 1): whether one overlaps generation depends on
    # timing at 4-token responses, which test_streamed_chunks_give_the_whole_batch_step makes long enough to tell
    assert len(_spans(read_trace(str(tmp_path / "timeline" / "timeline.json")), "trainer", "old_log_prob")) == 4 * 3
    one, two = read_scalars(gae_colocated), read_scalars(gae_split)
    _assert_same_run(one, two, (1, 2, 3, 4))
    _assert_same_run(one, read_scalars(tmp_path / "streamed"), (1, 2, 3))
    assert two["rollout/staleness/max"] == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    a, b = _hf_weights(gae_colocated / "hf"), _hf_weights(gae_split / "hf")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_streamed_chunks_give_the_whole_batch_step(tmp_path):
    """PPO at s = 1 with chunks of one prompt: reward, old/ref log-probs and values run per chunk as it
    arrives; the metrics equal the unstreamed s = 1 run (at s = 0 the synchronous test compares a streamed
    run with colocated). The actor's parameters are offloaded while the reference passes, so the deferred
    weight send that follows them must bring them back first (it read freed storage). The rollout ranks start
    the second chunk of the first batch only once the trainer has begun a chunk's passes (patched_run.py,
    STREAM_HOLD_FILE): without the hold, whether a pass overlapped generation was up to timing (it failed once
    under load)."""
    common = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "trainer.total_training_steps=3",
              "actor.offload.params=true", "async_training.staleness_threshold=1",
              "data.max_response_length=16", "rollout.max_num_seqs=1"] + SPLIT  # a chunk takes ~32 decode steps
    _torchrun(tmp_path / "whole", 2, common + [f"trainer.timeline_dir={tmp_path}/whole/timeline"])
    proc = _torchrun(tmp_path / "streamed", 2, common + ["async_training.stream_prompts=1",
                                                         f"trainer.timeline_dir={tmp_path}/streamed/timeline"],
                     script=PATCHED_RUN, env={"STREAM_HOLD_FILE": str(tmp_path / "a_pass_began")})
    assert "failed to bind" not in proc.stderr + proc.stdout  # rank 0 hosted the store torchrun's agent hosts
    _assert_same_run(read_scalars(tmp_path / "whole"), read_scalars(tmp_path / "streamed"), (1, 2, 3))
    from hybridrl.timeline import read_trace

    whole, streamed = (read_trace(str(tmp_path / run / "timeline" / "timeline.json")) for run in ("whole", "streamed"))
    names = {(e["cat"], e["name"]) for e in streamed if e["ph"] == "X"}
    assert {("trainer", "old_log_prob"), ("trainer", "ref"), ("trainer", "wait_rollout"), ("rollout", "gen"),
            ("rollout", "update_weights")} <= names, names
    assert {e["tid"] for e in streamed if e["ph"] == "X"} == {0, 1}
    # 4 prompts in chunks of one: 4 passes a step; step 1's batch (the others were generated during the
    # step before theirs) is still being generated while the passes on its first chunks run (the rows of a
    # chunk decode one after another: one KV slot)
    assert len(_spans(streamed, "trainer", "old_log_prob")) == 4 * 3 and len(_spans(whole, "trainer", "old_log_prob")) == 3
    assert _streamed_steps(streamed) >= 1 and _streamed_steps(whole) == 0


@pytest.mark.slow
def test_split_training_tp2_with_two_engine_replicas(grpo_colocated, tmp_path):
    """2 trainers at TP 2 stream TP-gathered weights to 2 rollout ranks, each its own engine replica
    sharing the prompts; GRPO with streamed chunks of one prompt gives the colocated run. Chunks smaller
    than the number of replicas are generated two at a time, one per replica, and still sent one by one."""
    _torchrun(tmp_path, 4, GRPO + ["trainer.total_training_steps=2", "parallel.tensor_model_parallel_size=2",
                                   "placement.mode=split", "placement.rollout_world_size=2",
                                   "async_training.stream_prompts=1", f"trainer.timeline_dir={tmp_path}/timeline"])
    scalars = read_scalars(tmp_path)
    _assert_same_run(read_scalars(grpo_colocated), scalars, (1, 2))
    assert scalars["rollout/staleness/max"] == scalars["rollout/staleness/mean"] == {1: 0.0, 2: 0.0}
    from hybridrl.timeline import read_trace

    # 4 prompts a step in rounds of 2: each replica generates one prompt of every round, so both work about as
    # long (a replica handed an empty share records a gen span of next to nothing: before, every chunk of one
    # prompt went to the last replica; 0.1, not closer to 1: a busy machine may slow one replica's process
    # several times over); the trainers still receive 4 chunks a step (a wait for each)
    events = read_trace(str(tmp_path / "timeline" / "timeline.json"))
    assert len(_spans(events, "trainer", "wait_rollout", 0)) == 4 * 2
    busy = {r: sum(e - s for _, _, s, e in _spans(events, "rollout", "gen", r)) for r in (2, 3)}
    assert len(_spans(events, "rollout", "gen", 2)) == len(_spans(events, "rollout", "gen", 3)) == 2 * 2
    assert min(busy.values()) > 0.1 * max(busy.values()), busy
    assert {e["tid"] for e in events if e["ph"] == "X" and e["cat"] == "rollout"} == {2, 3}


@pytest.mark.slow
def test_equal_tp_sends_shard_to_shard(grpo_colocated, tmp_path):
    """2 trainers at TP 2 and one engine at rollout TP 2 (2 + 2 ranks): each trainer TP rank sends its own
    megatron shards to the rollout rank of its TP rank, which loads them as they are (no TP gather, no HF
    tensors): per update the two streams carry the shards' bytes by hand (vocabulary padded, norms on both
    ranks), the larger of them under 60% of the HF stream that carried every tensor. The run is colocated's:
    batch 2 comes from update 1's weights, with the engine's log-probs as far from the trainer's as there."""
    _torchrun(tmp_path, 4, GRPO + ["trainer.total_training_steps=2", "parallel.tensor_model_parallel_size=2",
                                   "placement.mode=split", "placement.rollout_world_size=2",
                                   "rollout.tensor_model_parallel_size=2", f"trainer.export_hf_dir={tmp_path}/hf"])
    from test_split_data_paths import shard_bytes_by_stream

    scalars = read_scalars(tmp_path)
    _assert_same_run(read_scalars(grpo_colocated), scalars, (1, 2))
    hf = _hf_weights(tmp_path / "hf")
    streams = shard_bytes_by_stream(hf, 2, 1, 2)
    assert set(streams) == {(0, 0), (0, 1)}
    total, largest = sum(streams.values()), max(streams.values())
    assert scalars["perf/weight_sync_bytes"] == {1: total, 2: total}
    assert scalars["perf/weight_sync_sender_max_bytes"] == {1: largest, 2: largest}
    assert largest < 0.6 * sum(t.numel() * t.element_size() for t in hf.values())


@pytest.mark.slow
def test_one_step_off_policy(grpo_colocated, grpo_one_step_off):
    """Staleness 1: the first batch is colocated's; every later batch was generated one version behind
    the policy that trains on it (so the engine's log-probs now differ from the trainer's)."""
    one, two = read_scalars(grpo_colocated), read_scalars(grpo_one_step_off)
    _assert_same_run(one, two, (1,))
    later = range(2, 7)
    assert two["rollout/staleness/mean"] == two["rollout/staleness/max"] == {1: 0.0, **{s: 1.0 for s in later}}
    assert two["rollout/logprob_diff_mean"][1] < 1e-5
    assert min(two["rollout/logprob_diff_mean"][s] for s in later) > 1e-3
    overlap = two["perf/overlap"]  # each step's, logged under it once later answers bring the rollout's spans
    assert set(overlap) == {1, *later} and all(0.0 <= v <= 1.0 for v in overlap.values()) and max(overlap.values()) > 0
    # update k's weights leave once batch k+1 is in (during step k+1): their time and buckets are logged under
    # step k with its bytes (they were dropped: a deferred send's figures went nowhere); update 5's are superseded
    # by the last update's, sent at once and logged with step 6
    timed, buckets = two["perf/weight_sync_s"], two["perf/weight_sync_buckets"]
    assert set(timed) == {1, 2, 3, 4, 6} and all(t > 0 and buckets[s] >= 1 for s, t in timed.items()), (timed, buckets)


BAD = [
    (["placement.mode=split", "placement.rollout_world_size=1"], 1, "at least 2 processes"),
    (["placement.mode=split", "placement.rollout_world_size=2"], 2, "leaves no rank to train"),
    (["placement.mode=split", "placement.rollout_world_size=1", "rollout.tensor_model_parallel_size=2"], 3,
     "not a multiple of rollout.tensor_model_parallel_size"),
    (["placement.mode=split", "placement.rollout_world_size=1", "async_training.staleness_threshold=1",
      "algorithm.rollout_correction.bypass_mode=true"], 2, "bypass_mode"),
    (["async_training.staleness_threshold=1"], 1, "placement.mode=split"),
    (["placement.mode=split"], 2, "rollout_world_size=k > 0"),
    (["placement.rollout_world_size=1"], 2, "only apply with placement.mode=split"),
    (SPLIT + ["async_training.partial_rollout=true"], 2, "only async_training.staleness_threshold=1 has"),
    (["placement.mode=split", "placement.rollout_world_size=2", "async_training.staleness_threshold=1",
      "async_training.partial_rollout=true"], 3, "there are 2 engines"),
    (SPLIT + ["placement.critic_world_size=1", "algorithm.adv_estimator=gae"], 2, "leave no rank to train the actor"),
    (SPLIT + ["placement.critic_world_size=1"], 3, "trains no critic"),
    (SPLIT + ["placement.critic_world_size=1", "algorithm.adv_estimator=gae", "critic.tensor_model_parallel_size=2"], 3,
     "is not divisible by critic.tensor_model_parallel_size"),
    # streamed chunks differ by DP rank: no per-chunk collective over DP (it hung)
    (SPLIT + ["placement.critic_world_size=1", "algorithm.adv_estimator=gae", "async_training.stream_prompts=1"], 4,
     "stream_prompts > 0 at trainer dp=2: a critic of its own"),
    (SPLIT + ["model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_topk=2",
              "model.moe_intermediate_size=32", "parallel.expert_model_parallel_size=2",
              "async_training.stream_prompts=1"], 3, "stream_prompts > 0 at trainer dp=2: parallel.expert_model"),
    (SPLIT + ["async_training.stream_prompts=1", "trainer.balance_batch=true"], 3,
     "trainer.balance_batch moves whole prompt groups"),
]


@pytest.mark.parametrize("overrides,world,needle", BAD)
def test_impossible_placements_name_the_key(overrides, world, needle):
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config
    from hybridrl.config.layout import derive_layout

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        derive_layout(load_config(TINY, overrides), world, 64)


def test_split_with_one_process_is_one_error_line(tmp_path):
    env = dict(os.environ)
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
                          + _overrides(tmp_path, SPLIT), capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "placement.mode=split needs at least 2 processes" in errors[0], proc.stderr[-2000:]


def _launch_split(tmp, how: str):
    """A long split run (1 trainer + 1 rollout rank) launched by torchrun or, as srun does, one process
    per rank with RANK/WORLD_SIZE set; returns (processes, stdout file of rank 0 or torchrun)."""
    from dist_helper import free_port

    extra = SPLIT + ["trainer.total_training_steps=100000", "trainer.log_freq=1"]
    script = [os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY] + _overrides(tmp, extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.makedirs(tmp, exist_ok=True)
    logs = [open(tmp / f"out{r}.log", "w") for r in range(2)]
    if how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={env['MASTER_PORT']}"] + script
        return [subprocess.Popen(cmd, stdout=logs[0], stderr=subprocess.STDOUT, cwd=ROOT, env=env)], tmp / "out0.log"
    procs = [subprocess.Popen([sys.executable] + script, stdout=logs[r], stderr=subprocess.STDOUT, cwd=ROOT,
                              env=dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r))) for r in range(2)]
    return procs, tmp / "out0.log"


def _wait_for(path, text, timeout=120):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} never appeared in {path}: {path.read_text()[-2000:]}")


def _rollout_pid(procs):
    import psutil

    for p in [psutil.Process(x.pid) for x in procs]:
        for q in [p] + p.children(recursive=True):
            try:
                if q.environ().get("RANK") == "1" and "train_ppo.py" in " ".join(q.cmdline()):
                    return q.pid
            except psutil.Error:
                continue
    raise AssertionError("no rollout rank found")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["per-rank processes", "torchrun"])
def test_a_killed_rollout_rank_ends_the_job(tmp_path, how):
    """kill -9 of the rollout rank mid-run: the trainer ends within 30 s, non-zero, never hangs, and says
    which role and rank died and in which phase; launched rank by rank (as srun does) or by torchrun (whose
    own report of the dead rank comes besides)."""
    import signal

    from test_preemption import ends_within

    procs, log = _launch_split(tmp_path, how)
    try:
        _wait_for(log, "step:3")
        os.kill(_rollout_pid(procs), signal.SIGKILL)
        codes = ends_within(procs, 30)
    finally:
        for p in procs:
            p.kill()
    assert codes[0] != 0
    errors = [line for line in log.read_text().splitlines() if re.match(r"(\[rank0\]: )?error: ", line)]
    assert len(errors) == 1 and "rollout rank 1 died or stopped answering during" in errors[0], log.read_text()[-3000:]


def _popen_torchrun(tmp, nproc, extra):
    from dist_helper import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY] + _overrides(tmp, extra)
    os.makedirs(tmp, exist_ok=True)
    return subprocess.Popen(cmd, stdout=open(tmp / "out.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


@pytest.mark.slow
def test_resume_at_staleness_one_is_bit_exact(grpo_one_step_off, tmp_path):
    """Killed after its step-3 checkpoint, a one-step off-policy run resumes with the batch that was in
    flight (generated from step 2's weights) and continues exactly as the run that was never stopped."""
    import signal
    import time

    common = GRPO + SPLIT + ["async_training.staleness_threshold=1", "trainer.save_freq=3"]
    run = _popen_torchrun(tmp_path / "cut", 2, common + ["trainer.total_training_steps=1000"])
    published = tmp_path / "cut" / "ckpt" / "global_step_3" / "meta.json"
    try:
        deadline = time.monotonic() + 240
        while not published.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert published.exists(), (tmp_path / "cut" / "out.log").read_text()[-3000:]
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert (tmp_path / "cut" / "ckpt" / "global_step_3" / "in_flight.pt").exists()
    proc = _torchrun(tmp_path / "cut", 2, common + ["trainer.total_training_steps=6", f"trainer.timeline_dir={tmp_path}/tl"]
                     + _resumed_leg(tmp_path, "resumed"))
    assert_resumed(proc.stdout + proc.stderr, tmp_path / "resumed", 3, 6)
    full, cut = read_scalars(grpo_one_step_off), read_scalars(tmp_path / "resumed")
    _assert_same_run(full, cut, (4, 5, 6), rel=0.0)
    assert cut["rollout/staleness/mean"][4] == 1.0
    from hybridrl.timeline import read_trace

    # the resumed weights once (they went twice: the initial ones first), then update 4's before batch 6 is
    # asked for, and update 6's at the end (update 5's is replaced by 6's while batch 6 is in flight)
    received = [e for e in read_trace(str(tmp_path / "tl" / "timeline.json"))
                if e["ph"] == "X" and e["cat"] == "rollout" and e["name"] == "update_weights"]
    assert len(received) == 3, received


def _resume_from(checkpoint, tmp):
    shutil.copytree(checkpoint, tmp / "ckpt" / checkpoint.name)
    return tmp


@pytest.mark.slow
def test_checkpoints_cross_placements(gae_colocated, gae_split, tmp_path):
    """A split run's checkpoint resumes colocated, and a colocated one resumes split, at another world size."""
    steps = GAE + ["trainer.total_training_steps=4"]
    procs = {"a": _colocated(_resume_from(gae_split / "ckpt" / "global_step_2", tmp_path / "a"), steps),
             "b": _torchrun(_resume_from(gae_colocated / "ckpt" / "global_step_2", tmp_path / "b"), 2, steps + SPLIT)}
    reference = read_scalars(gae_colocated)
    for run, proc in procs.items():
        assert_resumed(proc.stdout + proc.stderr, tmp_path / run, 2, 4)
        _assert_same_run(reference, read_scalars(tmp_path / run), (3, 4))


def _writers(folder) -> set:
    """The ranks (of the saving group) that wrote a torch.distributed.checkpoint folder."""
    return {int(n.split("_")[2]) for n in os.listdir(folder) if n.endswith(".distcp")}


def _critic_rows_bytes(prompt_width: float, response_width: float) -> float:
    """Bytes of batch columns a critic of its own receives in one step, on all its ranks together: 4 prompts x
    n 2 = 8 rows; for `values` the token ids (int32) and attention mask (bool) of prompt + response columns
    and the response mask (bool); for `update` only the returns (fp32, the rest is held from `values`)."""
    rows, columns = 8, prompt_width + response_width
    return rows * (columns * (4 + 1) + response_width * (1 + 4))


@pytest.mark.slow
def test_a_critic_of_its_own(gae_colocated, tmp_path):
    """PPO with the critic on 2 ranks of its own at DP 2 (values pass and update beside the actor's): the
    colocated step; each critic rank received only its DP group's half of the rows; its checkpoint (critic
    part written by the critic ranks) resumes colocated."""
    _torchrun(tmp_path, 4, GAE + SPLIT + ["placement.critic_world_size=2", "critic.tensor_model_parallel_size=1",
                                          "trainer.total_training_steps=2", f"trainer.timeline_dir={tmp_path}/tl"])
    reference, scalars = read_scalars(gae_colocated), read_scalars(tmp_path)
    _assert_same_run(reference, scalars, (1, 2))
    # perf/rows_bytes: the trainer's rows from the rollout rank (8 rows of the batch's widest response, 9 bytes a
    # token: int32 id, bool mask, fp32 log-prob) and half the critic's columns on each of the 2 critic ranks
    # (the whole batch to both, as a broadcast sent it, was twice the critic's share)
    for step in (1, 2):
        prompt, response = scalars["prompt_length/max"][step], scalars["response_length/max"][step]
        rollout = 8 * response * 9
        assert scalars["perf/rows_bytes"][step] == rollout + _critic_rows_bytes(prompt, 4), (step, prompt, response)
    from hybridrl.timeline import read_trace

    # the critic's passes ran on its ranks (1 and 2) and nowhere else, each inside its step and ended before the
    # trainer got its answer (the end of rank 0's last span of that phase in the step; the critic may finish
    # while the trainer still runs the actor's passes)
    events = read_trace(str(tmp_path / "tl" / "timeline.json"))
    assert {tid for tid, *_ in _spans(events, "critic")} == {1, 2}
    marks = {e["name"]: e["ts"] / 1e6 for e in events if e["ph"] == "i" and e["tid"] == 0}
    for phase in ("values", "update_critic"):
        asked = _spans(events, "trainer", phase)  # rank 0 sending the request or waiting for the answer
        assert {t for t, *_ in asked} == {0}
        for rank in (1, 2):
            done = _spans(events, "critic", phase, rank)
            assert len(done) == 2, (phase, rank, done)
            for step, (_, _, start, end) in zip((1, 2), done):
                lo, hi = marks[f"step {step}"], marks[f"step {step} end"]
                answered = max(a[3] for a in asked if lo <= a[2] <= hi)
                assert lo <= start and end <= answered, (phase, rank, step, done, asked)
    assert not _spans(events, "rollout", "values") and not _spans(events, "rollout", "update_critic")
    # the critic's part saved by its 2 ranks, DP replicas written once: by the critic's first rank (a shard file
    # per writer, __<rank>_<n>.distcp, ranks of the critic's world); the actor's by the trainer
    assert {t for t, *_ in _spans(events, "critic", "save")} == {1, 2}
    assert _writers(tmp_path / "ckpt" / "global_step_2" / "critic") == {0}
    assert _writers(tmp_path / "ckpt" / "global_step_2" / "actor") == {0}
    proc = _colocated(tmp_path, GAE + ["trainer.total_training_steps=4"] + _resumed_leg(tmp_path, "resumed"))
    assert_resumed(proc.stdout + proc.stderr, tmp_path / "resumed", 2, 4)
    _assert_same_run(reference, read_scalars(tmp_path / "resumed"), (3, 4))


@pytest.mark.slow
def test_partial_rollout_takes_new_weights_mid_generation(tmp_path):
    """Staleness 1 with partial rollout: update k's weights reach the engine between two decode steps of
    batch k+1, so the rows it starts afterwards (one KV slot: 16 rows of up to 32 tokens, one after another)
    are not stale; a row keeps the oldest version that produced any of its tokens. Decoding of every batch
    after the first waits at decode step 8 until the trainers announce the update (patched_run.py,
    PARTIAL_HOLD_STEP), so that every such step holds rows of both kinds on any machine, however busy (without
    the hold, whether the update came mid-generation was up to timing)."""
    _torchrun(tmp_path, 2, SPLIT + ["async_training.staleness_threshold=1", "async_training.partial_rollout=true",
                                    "data.train_batch_size=8", "data.max_response_length=32",
                                    "rollout.max_num_seqs=1", "trainer.total_training_steps=5"],
              script=PATCHED_RUN, env={"PARTIAL_HOLD_STEP": "8"})
    scalars = read_scalars(tmp_path)
    mean, worst = scalars["rollout/staleness/mean"], scalars["rollout/staleness/max"]
    assert mean[1] == 0.0 and worst[1] == 0.0
    for s in range(2, 6):  # each step: rows begun under the old weights and rows begun under the new ones
        assert 0.0 < mean[s] < 1.0 and worst[s] == 1.0, (s, mean, worst)
