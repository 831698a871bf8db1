"""End to end: the trainer under several layouts, DP invariance, resume, TensorBoard names, NaN stop."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from dist_helper import free_port, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
FAST = ["data.train_batch_size=4", "rollout.n=2", "data.max_response_length=4", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
        "data.val_batch_size=16", "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.progress_bar=false",
        "model.num_layers=2", "rollout.free_cache_engine=false"]


def _overrides(tmp, extra):
    return FAST + [f"data.train_files=[{tmp}/data/train.parquet]", f"data.val_files=[{tmp}/data/test.parquet]",
                   f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/tb"] + list(extra)


def read_scalars(tmp) -> dict:
    """{tag: {step: value}} from the TensorBoard event files of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for path in glob.glob(os.path.join(str(tmp), "tb", "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def assert_resumed(out: str, tmp, step: int, last: int) -> None:
    """The run said it resumed from step `step`'s checkpoint and its TensorBoard folder (`tmp`/tb) holds
    exactly the steps after it, to `last`: a fresh start would log from step 1."""
    assert re.search(rf"resumed from \S*global_step_{step} at step {step}\n", out), out[-3000:]
    logged = {s for by_step in read_scalars(tmp).values() for s in by_step}
    assert logged == set(range(step + 1, last + 1)), sorted(logged)


def _train(config_path, overrides):
    from hybridrl.config.io import load_config
    from hybridrl.trainer.loop import main_loop

    return main_loop(load_config(config_path, overrides))


def _train_printing_to(out_file, config_path, overrides):
    """`_train` with its rank's stdout in `out_file`: run_distributed's forkserver children keep the fd 1 the
    forkserver started with, which pytest's capfd does not see once an earlier test started it."""
    import contextlib

    with open(out_file, "w") as out, contextlib.redirect_stdout(out):
        return _train(config_path, overrides)


def _torchrun(tmp, nproc, extra, timeout=300, port_tries=2, script=None, env=None):
    """train_ppo.py (or `script`, which runs it) under torchrun, with `env` added to the environment; once
    more on another port when another process took the free one first."""
    script = script or os.path.join(ROOT, "scripts", "train_ppo.py")
    # a hung phase ends the run before the timeout, with every thread's stack in the failure's message
    watchdog = [f"trainer.hang_timeout_s={max(timeout - 60, 30)}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           script, "--config", TINY] + _overrides(tmp, watchdog + list(extra))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    if proc.returncode != 0 and port_tries > 1 and "EADDRINUSE" in proc.stderr:
        return _torchrun(tmp, nproc, extra, timeout, port_tries - 1, script, env)
    hangs = "".join(open(f).read()[-4000:] for f in sorted(glob.glob(os.path.join(tmp, "tb", "**", "hang_rank*.txt"),
                                                                     recursive=True)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:] + hangs
    return proc


LAYOUTS = [("grpo", 2, 1, 2), ("grpo", 1, 2, 2), ("grpo", 1, 1, 2), ("gae", 2, 1, 2), ("gae", 1, 2, 2), ("gae", 1, 1, 2)]
# GAE at PP=2 runs with token-budget micro-batches (variable shapes through the pipeline schedule).
# GRPO at PP=2 also exercises the KL loss with an offloaded reference, recomputation and HF export.
EXTRAS = {("grpo", 1, 1): ["trainer.balance_batch=true"],  # DP 2: the groups move, the first step is world 1's
          ("gae", 1, 2): ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40",
                          "actor.log_prob_max_token_len_per_gpu=60", "critic.ppo_max_token_len_per_gpu=48"],
          ("grpo", 1, 2): ["actor.use_kl_loss=true", "ref.offload_params=true", "parallel.recompute_activations=true",
                           "actor.offload.optimizer=true", "actor.offload.grads=true", "actor.offload.params=true", "model.tie_word_embeddings=false"]}


@pytest.mark.slow
def test_remax_baseline_is_the_greedy_score(tmp_path):
    """ReMax measures samples against one greedy response per prompt: over a batch that is the whole
    validation set, the baseline's mean equals validation's greedy reward before training (another
    code path), at DP 2. The reward (a function of the text) gives a random model varied scores."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(ord(c) % 7 for c in solution_str) / 10.0\n")
    _torchrun(tmp_path, 2, ["algorithm.adv_estimator=remax", f"data.train_files=[{tmp_path}/data/test.parquet]",
                            "data.train_batch_size=100", "actor.ppo_mini_batch_size=100",
                            "actor.ppo_micro_batch_size_per_gpu=100", "trainer.val_before_train=true",
                            "trainer.total_training_steps=1", f"reward.custom_function.path={reward}",
                            f"trainer.rollout_data_dir={tmp_path}/rollouts", f"trainer.validation_data_dir={tmp_path}/val"])
    scalars = read_scalars(tmp_path)
    greedy = scalars["val-core/synthetic/arith/acc/mean@1"][0]  # a float score is also "acc", as verl's managers
    assert greedy > 0 and scalars["actor/grad_norm"][1] > 0
    assert scalars["critic/remax_baseline/mean"][1] == pytest.approx(greedy, rel=1e-6)
    # the generation dumps hold both DP ranks' rows once each: the 100 prompts, twice each in training (rollout.n)
    val = [json.loads(line) for line in (tmp_path / "val" / "0.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(val) == 100 and sum(d["score"] for d in val) / 100 == pytest.approx(greedy, rel=1e-6)
    assert sorted(d["input"] for d in train) == sorted(d["input"] for d in val for _ in range(2))
    assert sum(d["score"] for d in train) / len(train) == pytest.approx(scalars["critic/score/mean"][1], rel=1e-6)


def test_val_only_validates_and_ends(tmp_path):
    """verl's trainer.val_only: the validation before training, logged at step 0, and nothing else (no step, no
    checkpoint, no export); without validation files or val_before_train it is refused by name."""
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config

    run_distributed(_train, 1, TINY, _overrides(tmp_path, [
        "trainer.val_only=true", "trainer.val_before_train=true", "trainer.save_freq=1", "trainer.total_training_steps=2",
        f"trainer.export_hf_dir={tmp_path}/hf", f"trainer.validation_data_dir={tmp_path}/val",
        "trainer.log_val_generations=3"]))
    scalars = read_scalars(tmp_path)
    _check_logged_generations(tmp_path, 3)
    assert set(scalars["val-core/synthetic/arith/acc/mean@1"]) == {0}
    assert not [k for k in scalars if k.startswith("actor/")] and not list((tmp_path / "ckpt").glob("global_step_*"))
    assert not (tmp_path / "hf").exists() and (tmp_path / "val" / "0.jsonl").exists()
    with pytest.raises(ConfigError, match="needs trainer.val_before_train=true"):
        load_config(TINY, ["trainer.val_only=true", "trainer.val_before_train=false"])
    with pytest.raises(ConfigError, match="set data.val_files"):
        load_config(TINY, ["trainer.val_only=true", "data.val_files=[]"])


@pytest.mark.distributed
def test_validation_with_an_empty_shard_under_a_wider_rollout_tp(tmp_path):
    """Training TP 1 (DP 2) with rollout TP 2: the engine's TP group spans both DP ranks and decodes their prompts
    as one batch. Validation's last batch holds one prompt (99 + 1 of 100), so rank 1's shard of it is empty: rank 1
    must still join the engine's generation (it skipped it, and rank 0 waited for it until the timeout). Every
    prompt is validated once, each response scored as world 1's greedy validation of the same prompts scores it."""
    val = ["trainer.val_only=true", "trainer.val_before_train=true", "data.val_batch_size=99",
           "rollout.val_kwargs.temperature=0", "trainer.dist_timeout_s=60"]
    run_distributed(_train, 2, TINY, _overrides(tmp_path / "two", val + [
        f"trainer.validation_data_dir={tmp_path}/two/val", "rollout.tensor_model_parallel_size=2"]), timeout=240)
    run_distributed(_train, 1, TINY, _overrides(tmp_path / "one", val + [f"trainer.validation_data_dir={tmp_path}/one/val"]))
    lines = {side: [json.loads(line) for line in (tmp_path / side / "val" / "0.jsonl").read_text().splitlines()]
             for side in ("one", "two")}
    assert len(lines["two"]) == len(lines["one"]) == 100
    assert sorted((d["input"], d["score"]) for d in lines["two"]) == sorted((d["input"], d["score"]) for d in lines["one"])


JUDGE = """import json, os, random

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = random.random()  # a judge that never repeats itself
    with open({log!r}, "a") as f:
        f.write(json.dumps([os.getpid(), solution_str, score]) + "\\n")
    return score
"""


@pytest.mark.distributed
def test_a_reward_is_computed_once_per_row_at_tp2(tmp_path):
    """At training TP 2 the reward function runs on one rank of the model replica and its scores reach the other:
    a judge that answers at random is asked once per response (it was asked by both TP ranks, which then trained
    on different scores), and the step's logged score is the mean of the scores it gave."""
    log, reward = tmp_path / "judged.jsonl", tmp_path / "judge.py"
    reward.write_text(JUDGE.format(log=str(log)))
    run_distributed(_train, 2, TINY, _overrides(tmp_path, [
        "parallel.tensor_model_parallel_size=2", "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1",
        f"reward.custom_function.path={reward}"]))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4 * 2 and len({pid for pid, _, _ in calls}) == 1, calls  # 4 prompts x rollout.n 2
    logged = read_scalars(tmp_path)["critic/score/mean"][1]
    assert logged == pytest.approx(sum(score for _, _, score in calls) / len(calls), rel=1e-5), (logged, calls)


def _check_logged_generations(tmp_path, n):
    """verl's trainer.log_val_generations: n of the validation's (prompt, response, score), chosen as verl does
    (sorted by prompt, shuffled by RandomState(42)), as TensorBoard text at the validation's step."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = [json.loads(line) for line in (tmp_path / "val" / "0.jsonl").read_text().splitlines()]
    chosen = sorted(((d["input"], d["output"], d["score"]) for d in lines), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(chosen)
    (path,) = glob.glob(os.path.join(str(tmp_path), "tb", "**", "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(path, size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("val/generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 0 and text.count("### Sample") == n
    for i, (prompt, response, score) in enumerate(chosen[:n]):
        assert f"### Sample {i + 1}\n**Input:** {prompt}\n\n**Output:** {response}\n\n**Score:** {score}" in text


# What the single-process run a layout is compared with shares with it: the estimator and what changes the
# model or the loss (recomputation, offloading and token-budget micro-batches change neither).
SAME_MATH = ("actor.use_kl_loss=true", "model.tie_word_embeddings=false")
# The reference runs also set the weight-sync keys no other run sets (rollout.verify_weights,
# rollout.update_weights_bucket_mb); the handoffs they asked for are recorded.
HANDOFF = {"grpo": ["rollout.verify_weights=exact", "rollout.update_weights_bucket_mb=3",
                    "rollout.share_weights=false"],  # the copy path: what verify_weights checks
           "gae": ["rollout.verify_weights=off", "rollout.share_weights=false"]}
FIRST_STEP = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
              "critic/score/mean", "critic/advantages/mean", "critic/returns/mean", "response_length/mean")
_single = {}


def _train_recording_handoffs(config_path, overrides):
    """_train, with every weight handoff into the engine recorded (its bucket size and check) and the weight
    digests computed on either side counted by mode (the engine's read-back, the trainer's of what it sent)."""
    from collections import Counter

    from hybridrl.placement import readback, reshard
    from hybridrl.rollout import native

    reports, handoff, digests = [], reshard.update_engine_weights, Counter()
    reshard.update_engine_weights = lambda *a, **kw: reports.append(handoff(*a, **kw)) or reports[-1]
    # the trainer's digests: of the slices it checks the read-back against (readback, as each engine stores them)
    def counting(real, side):
        def digests_of(tensors, mode):
            tensors = list(tensors)
            digests.update([(side, mode)] * len(tensors))
            return real(tensors, mode)
        return digests_of

    for side, module in (("trainer", readback), ("engine", native)):
        module.weight_digests = counting(module.weight_digests, side)
    _train(config_path, overrides)
    return [(r.bucket_bytes, r.verify, r.verified, r.num_tensors) for r in reports], dict(digests)


def _single_process(tmp_path_factory, estimator, extras):
    """TensorBoard scalars and handoffs of one step in one process, once per estimator and model."""
    key = (estimator, tuple(e for e in extras if e in SAME_MATH))
    if key not in _single:
        tmp = tmp_path_factory.mktemp(f"single_{estimator}")
        extra = [f"algorithm.adv_estimator={estimator}", "trainer.total_training_steps=1", *key[1], *HANDOFF[estimator]]
        handoffs = run_distributed(_train_recording_handoffs, 1, TINY, _overrides(tmp, extra))
        _single[key] = read_scalars(tmp), handoffs[0]  # (handoffs, digests)
    return _single[key]


SCORE_AND_RECORD = """import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = sum(ord(c) % 7 for c in solution_str) / 10.0
    with open({log!r}, "a") as f:
        f.write(json.dumps([solution_str, score]) + "\\n")
    return {{"score": score, "acc": float(round(score * 10) % 2 == 0), "pred": solution_str}}
"""


@pytest.mark.slow
def test_sampled_validation_n4_by_hand(tmp_path):
    """rollout.val_kwargs.n=4 with sampling through the trainer: validation (before training) scores 4 sampled
    responses per prompt; mean@4, std@4 and best@4 (verl's bootstrap) computed here from what the reward
    function saw. The reward is a function of the text, so a random model gets varied values."""
    import numpy as np
    import pyarrow.parquet as pq

    log, reward = tmp_path / "scored.jsonl", tmp_path / "reward.py"
    reward.write_text(SCORE_AND_RECORD.format(log=str(log)))
    run_distributed(_train, 1, TINY, _overrides(tmp_path, [
        "trainer.val_before_train=true", "trainer.total_training_steps=1", f"reward.custom_function.path={reward}",
        "rollout.val_kwargs.n=4", "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0",
        f"trainer.rollout_data_dir={tmp_path}/rollouts", f"trainer.validation_data_dir={tmp_path}/val"]))
    prompts = pq.read_table(tmp_path / "data" / "test.parquet").num_rows
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == prompts * 4 + 4 * 2  # validation first, then the training step's 4 x 2
    # verl's generation dumps hold what the reward function saw and returned, in order (its dict's keys too)
    for path, part in ((tmp_path / "val" / "0.jsonl", seen[:prompts * 4]), (tmp_path / "rollouts" / "1.jsonl",
                                                                                seen[prompts * 4:])):
        dumped = [json.loads(line) for line in path.read_text().splitlines()]
        assert [[d["output"], d["score"]] for d in dumped] == part and all(d["pred"] == d["output"] for d in dumped)
    groups = [seen[4 * p:4 * p + 4] for p in range(prompts)]  # a prompt's responses are consecutive
    assert sum(len({text for text, _ in g}) > 1 for g in groups) > prompts // 2  # sampled, not greedy
    score = np.array([[s for _, s in g] for g in groups])
    acc = (np.round(score * 10) % 2 == 0).astype(float)
    idx = np.random.RandomState(42).choice(4, size=(1000, 4), replace=True)  # verl's bootstrap draws
    expected = {"val-core/synthetic/arith/acc/mean@4": acc.mean(),
                "val-aux/synthetic/arith/reward/mean@4": score.mean(),
                "val-aux/synthetic/arith/reward/std@4": score.std(axis=1).mean(),
                "val-core/synthetic/arith/acc/best@4/mean": acc[:, idx].max(axis=2).mean(),
                "val-aux/synthetic/arith/reward/worst@4/mean": score[:, idx].min(axis=2).mean()}
    scalars = read_scalars(tmp_path)
    assert "val-core/synthetic/arith/acc/maj@4/mean" in scalars
    for key, value in expected.items():
        assert scalars[key][0] == pytest.approx(value, rel=1e-6), (key, scalars[key], value)
    assert 0 < expected["val-core/synthetic/arith/acc/mean@4"] < expected["val-core/synthetic/arith/acc/best@4/mean"]


@pytest.mark.slow
@pytest.mark.parametrize("estimator,tp,pp,nproc", LAYOUTS)
def test_torchrun_layouts(tmp_path, tmp_path_factory, estimator, tp, pp, nproc):
    """Two steps under torchrun; the first step's metrics equal the single-process run's."""
    extras = EXTRAS.get((estimator, tp, pp), [])
    export = tmp_path / "hf_export"
    _torchrun(tmp_path, nproc, [f"algorithm.adv_estimator={estimator}", f"parallel.tensor_model_parallel_size={tp}",
                                f"parallel.pipeline_model_parallel_size={pp}", "trainer.total_training_steps=2",
                                f"trainer.export_hf_dir={export}"] + extras)
    scalars = read_scalars(tmp_path)
    assert set(scalars["actor/pg_loss"]) == {1, 2}
    single, _ = _single_process(tmp_path_factory, estimator, extras)
    keys = list(FIRST_STEP)
    if estimator == "gae":
        keys += ["critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/values/mean"]
    if "actor.use_kl_loss=true" in extras:
        keys.append("actor/kl_loss")
    for key in keys:
        got, want = scalars[key][1], single[key][1]
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (key, got, want)
    if estimator == "gae":
        assert "critic/vf_loss" in scalars and "critic/values/mean" in scalars
    if "trainer.balance_batch=true" in extras:
        seqlen = {k.split("/")[1]: v[1] for k, v in scalars.items() if k.startswith("global_seqlen/")}
        assert seqlen["balanced_max"] <= seqlen["max"] and seqlen["balanced_min"] >= seqlen["min"], seqlen
        dp = nproc // (tp * pp)
        alone = {k.split("/")[1]: v[1] for k, v in single.items() if k.startswith("global_seqlen/")}
        # world 1: nothing moves, every figure is the step's tokens, the DP ranks' together
        assert alone["max"] == alone["min"] == alone["balanced_max"] == alone["mean"] == seqlen["mean"] * dp, alone
    if "actor.use_kl_loss=true" in extras:
        assert "actor/kl_loss" in scalars and "timing_s/ref" in scalars
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.slow
@pytest.mark.parametrize("estimator", sorted(HANDOFF))
def test_weight_sync_keys_reach_the_handoff(tmp_path_factory, estimator):
    """rollout.verify_weights and rollout.update_weights_bucket_mb as the trainer hands them over, at start
    and after the update (the single-process runs of test_torchrun_layouts, reused): with exact, both sides
    hash every tensor of both handoffs; with off, nothing is hashed."""
    _, (handoffs, digests) = _single_process(tmp_path_factory, estimator, [])
    mb = 3 if estimator == "grpo" else 64
    verify = "exact" if estimator == "grpo" else "off"
    tensors = handoffs[0][3]
    assert handoffs == [(mb * 2 ** 20, verify, verify != "off", tensors)] * 2 and tensors > 10, handoffs
    expected = {("trainer", "exact"): 2 * tensors, ("engine", "exact"): 2 * tensors} if verify == "exact" else {}
    assert digests == expected, digests


# no timing_s/values: with one critic step per batch the values come from the critic update's forward
METRIC_NAMES = [f"timing_s/{k}" for k in ("gen", "old_log_prob", "ref", "adv", "update_critic",
                                          "update_actor", "update_weights", "step")] + [
    "perf/throughput", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
    "actor/lr", "critic/vf_loss", "critic/vf_clipfrac", "critic/score/mean", "critic/rewards/mean",
    "critic/advantages/mean", "critic/returns/mean", "critic/values/mean", "response_length/mean",
    "response_length/max", "response_length/clip_ratio", "rollout/logprob_diff_mean", "rollout/logprob_diff_max"]


# the adaptive KL controller: 8 responses a step (4 prompts x 2), a short horizon so each update shows
KL_CTRL = ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.025",
           "algorithm.kl_ctrl.horizon=100"]


@pytest.mark.slow
def test_resume_is_bit_exact_and_tensorboard_names(tmp_path):
    """Also the adaptive KL controller inside the trainer (its coefficient by hand from the logged KL, and
    restored by the resume) and trainer.critic_warmup=2 (verl's count: the actor sits out step 1). The resumed
    leg logs to a folder of its own: it must hold steps 5-8 only (a fresh start, deterministic, would give the
    same values from step 1 on) and the run must say where it resumed."""
    common = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "trainer.save_freq=4",
              "trainer.test_freq=4", "trainer.critic_warmup=2"] + KL_CTRL
    run_distributed(_train, 1, TINY, _overrides(tmp_path / "full", common + ["trainer.total_training_steps=8"]))
    # the full run's step-4 save (save_freq 4; constant learning rate: a run stopped at 4 saves the same state)
    # and its data, in a folder of their own: the resumed leg must take steps 5-8 from them alone
    shutil.copytree(tmp_path / "full" / "data", tmp_path / "part" / "data")
    shutil.copytree(tmp_path / "full" / "ckpt" / "global_step_4", tmp_path / "part" / "ckpt" / "global_step_4")
    out_file = tmp_path / "resumed.out"
    run_distributed(_train_printing_to, 1, str(out_file), TINY, _overrides(tmp_path / "part", common + [
        "trainer.total_training_steps=8", f"trainer.log_dir={tmp_path}/resumed/tb"]))
    assert_resumed(out_file.read_text(), tmp_path / "resumed", 4, 8)
    full, part = read_scalars(tmp_path / "full"), read_scalars(tmp_path / "resumed")
    missing = [n for n in METRIC_NAMES if n not in full]
    assert not missing, f"metrics missing from TensorBoard: {missing}"
    assert "val-core/synthetic/arith/acc/mean@1" in full and "val-aux/synthetic/arith/reward/mean@1" in full
    # as verl's step timer, timing_s/step holds the step's checkpoint save (timing_s/save_checkpoint, steps 4
    # and 8 only), and perf/throughput is over that time
    saves = full["timing_s/save_checkpoint"]
    assert set(saves) == {4, 8}, saves
    for s in (4, 8):
        stages = sum(full[f"timing_s/{k}"][s] for k in ("gen", "update_actor", "update_critic", "update_weights"))
        assert stages + saves[s] <= full["timing_s/step"][s] * (1 + 1e-6), (s, stages, saves[s])
        assert full["perf/throughput"][s] == pytest.approx(full["perf/total_num_tokens"][s] / full["timing_s/step"][s])
    for key in ("actor/pg_loss", "critic/vf_loss", "critic/score/mean", "actor/grad_norm", "actor/ppo_kl",
                "actor/reward_kl_penalty_coeff"):
        for step in range(5, 9):
            assert full[key][step] == part[key][step], (key, step, full[key][step], part[key][step])
    # critic warmup: step 1 trains the critic alone, so step 2 still samples from (and measures KL of) the
    # initial policy; the actor's first update is step 2's
    assert set(full["critic/vf_loss"]) == set(range(1, 9)) and set(full["actor/pg_loss"]) == set(range(2, 9))
    kl, coef = full["actor/reward_kl_penalty"], full["actor/reward_kl_penalty_coeff"]
    assert abs(kl[1]) < 1e-6 and abs(kl[2]) < 1e-6 and abs(kl[3]) > 1e-4, kl
    # verl's controller, updated once a step by the batch's rows (ray_trainer.apply_kl_penalty: n_steps is
    # the number of responses): coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * rows / horizon
    assert coef[1] == pytest.approx(0.05, rel=1e-7)
    for step in range(1, 8):
        error = min(max(kl[step] / 0.025 - 1, -0.2), 0.2)
        assert coef[step + 1] == pytest.approx(coef[step] * (1 + error * 8 / 100), rel=1e-6), (step, kl, coef)
    assert any(abs(kl[t] / 0.025 - 1) < 0.2 for t in range(3, 8)), kl  # not every step at the clip


@pytest.mark.slow
def test_nan_loss_stops_with_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
        + _overrides(tmp_path, ["actor.optim.lr=1e30", "actor.optim.clip_grad=0", "trainer.total_training_steps=4",
                                "trainer.save_freq=1", "trainer.logger=[console]"]),
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "step 2" in proc.stderr and "not finite" in proc.stderr and "Traceback" not in proc.stderr
    from hybridrl.checkpoint import CheckpointManager, read_meta

    ckpt = CheckpointManager(str(tmp_path / "ckpt"), 2)
    assert ckpt.latest().endswith("global_step_1")
    meta = read_meta(ckpt.latest())
    assert meta["step"] == 1 and meta["roles"] == ["actor"]


@pytest.mark.slow
def test_dry_run_and_profile(tmp_path):
    import re

    script = [sys.executable, os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", TINY]
    dry = subprocess.run(script + ["--dry-run"] + _overrides(tmp_path, ["algorithm.adv_estimator=gae",
                                                                       f"trainer.rollout_data_dir={tmp_path}/dumps"]),
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert not os.path.exists(tmp_path / "dumps"), "a dry run dumps no generations"
    for fragment in ("actor/pg_loss", "critic/vf_loss", "critic/advantages/mean", "process groups",
                     "memory per GPU", "Ready for real training"):
        assert fragment in dry.stdout, fragment
    assert not os.path.exists(tmp_path / "tb"), "a dry run writes no TensorBoard events"
    prof = subprocess.run(script + ["--profile"] + _overrides(tmp_path / "p", [
        "algorithm.adv_estimator=gae", "trainer.total_training_steps=2"]),
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert prof.returncode == 0, prof.stderr[-3000:]
    line = r"Rollout: \d+ tokens/s \| Actor: \d+ tokens/s \| Critic: \d+ tokens/s \| Total: [\d.]+ s/step"
    assert len(re.findall(r"\[STEP \d\] " + line, prof.stdout)) == 2
    assert re.search(r"\[AVERAGE over 2 steps\] " + line, prof.stdout)
