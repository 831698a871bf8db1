"""The trainer's passes: old log-probs from the actor update's own forward, and GAE values from the
critic update's own forward, equal separate passes (same step metrics, same parameters), and the
separate passes stay wherever the math needs them."""
import os

import pytest
import torch

from dist_helper import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def _overrides(tmp, extra=()):
    return ["data.train_batch_size=4", "rollout.n=2", "data.max_response_length=6", "actor.ppo_mini_batch_size=4",
            "critic.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
            "actor.log_prob_micro_batch_size_per_gpu=4", "algorithm.adv_estimator=gae", "trainer.progress_bar=false",
            f"data.train_files=[{tmp}/data/train.parquet]", f"data.val_files=[{tmp}/data/test.parquet]",
            f"trainer.default_local_dir={tmp}/ckpt", "rollout.free_cache_engine=false"] + list(extra)


def _two_trainers(tmp, extra, source="old_log_prob_source"):
    """One step of the same batch on two trainers built alike: the first takes `source` (its old
    log-probs, or its values) where the config says, the second always runs the separate pass.
    Returns per trainer the allowed source, the step's metrics and the actor's and critic's parameters."""
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.loop import setup_run

    cfg = load_config(TINY, _overrides(tmp, extra))
    _, tok, layout, groups, loader, _ = setup_run(cfg)
    prompts = next(iter(loader))
    out = []
    for own in (True, False):
        trainer = PPOTrainer(cfg, layout, groups, tok, build_roles(cfg, groups, tok, 4), RewardManager(cfg.reward), None)
        allowed = getattr(trainer, source)
        setattr(trainer, source, allowed if own else "pass")
        trainer.sync_rollout_weights()
        metrics = trainer.train_step(prompts, 1)
        params = [p.detach().clone() for w in (trainer.actor, trainer.critic) if w is not None
                  for p in w.engine.module.parameters()]
        out.append(dict(allowed=allowed, metrics=metrics, params=params))
    return out


def _assert_same_step(own, two, skipped_stage, rel):
    """The one-pass step skips `skipped_stage` and otherwise reports and updates what the two-pass one does."""
    assert f"timing_s/{skipped_stage}" not in own["metrics"] and f"timing_s/{skipped_stage}" in two["metrics"]
    keys = {k for k in two["metrics"] if not k.startswith(("timing_s/", "perf/throughput", "perf/weight_sync_s"))}  # times
    assert keys <= set(own["metrics"])
    for key in sorted(keys):
        a, b = own["metrics"][key], two["metrics"][key]
        assert abs(a - b) <= rel * max(1.0, abs(b)), (key, a, b)
    for a, b in zip(own["params"], two["params"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("world", [1, 2])
def test_own_old_log_probs_give_the_two_pass_step(tmp_path, world):
    own, two = run_distributed(_two_trainers, world, str(tmp_path), [])[0]
    assert own["allowed"] == "update", "ppo_epochs 1, one mini-batch, no KL in reward: the update's forward is used"
    _assert_same_step(own, two, "old_log_prob", 1e-6)
    assert own["metrics"]["actor/ppo_kl"] == 0.0


@pytest.mark.parametrize("extra", [["algorithm.use_kl_in_reward=true"], ["actor.ppo_epochs=2"],
                                   ["actor.ppo_mini_batch_size=2"], ["algorithm.rollout_correction.rollout_is=token"],
                                   ["algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                                    "algorithm.rollout_correction.rollout_rs_threshold=0.01"]])
def test_separate_old_log_prob_pass_where_needed(tmp_path, extra):
    from hybridrl.config.io import load_config
    from hybridrl.config.layout import derive_layout
    from hybridrl.workers.actor import old_log_prob_source

    cfg = load_config(TINY, _overrides(tmp_path, extra))
    assert old_log_prob_source(cfg, derive_layout(cfg, 1, vocab_size=64)) == "pass"


@pytest.mark.distributed
@pytest.mark.parametrize("world,extra", [(1, ["algorithm.use_kl_in_reward=true"]), (2, []),
                                         (2, ["parallel.pipeline_model_parallel_size=2"])])
def test_values_from_the_critic_update_give_the_two_pass_step(tmp_path, world, extra):
    """GAE with one critic step: the values, returns and advantages taken from the critic update's
    own forward give the step of a separate values pass (metrics and both models' parameters), at
    DP 2 and PP 2 too, with the KL penalty in the reward as well."""
    runs = run_distributed(_two_trainers, world, str(tmp_path), extra, "values_source")
    for own, two in runs:
        assert own["allowed"] == "update"
        _assert_same_step(own, two, "values", 1e-5)
        assert own["metrics"]["critic/vf_clipfrac"] == 0.0


@pytest.mark.parametrize("extra", [["critic.ppo_epochs=2"], ["critic.ppo_mini_batch_size=2"]])
def test_separate_values_pass_where_needed(tmp_path, extra):
    from hybridrl.config.io import load_config
    from hybridrl.config.layout import derive_layout
    from hybridrl.workers.critic import values_source

    cfg = load_config(TINY, _overrides(tmp_path, extra))
    assert values_source(cfg, derive_layout(cfg, 1, vocab_size=64)) == "pass"


def test_bypass_mode_takes_the_engines_log_probs_as_old(tmp_path):
    """verl's rollout_correction.bypass_mode: no old-log-prob pass, even where one is otherwise needed
    (KL in the reward); the engine's log-probs equal the trainer's to fp32 round-off here, so the step
    equals the two-pass step to that tolerance."""
    extra = ["algorithm.use_kl_in_reward=true", "algorithm.rollout_correction.bypass_mode=true"]
    bypass, two = run_distributed(_two_trainers, 1, str(tmp_path), extra)[0]
    assert bypass["allowed"] == "rollout"
    assert "timing_s/old_log_prob" not in bypass["metrics"] and "timing_s/old_log_prob" in two["metrics"]
    assert "rollout/logprob_diff_mean" not in bypass["metrics"]  # nothing to compare against
    for key in ("actor/pg_loss", "critic/vf_loss", "critic/rewards/mean", "critic/advantages/mean"):
        a, b = bypass["metrics"][key], two["metrics"][key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (key, a, b)
    for a, b in zip(bypass["params"], two["params"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_bypass_mode_takes_no_pass_whatever_it_corrects(tmp_path):
    from hybridrl.config.io import load_config
    from hybridrl.config.layout import derive_layout
    from hybridrl.workers.actor import old_log_prob_source

    cfg = load_config(TINY, _overrides(tmp_path, ["algorithm.rollout_correction.bypass_mode=true",
                                                  "algorithm.rollout_correction.rollout_is=token"]))
    assert old_log_prob_source(cfg, derive_layout(cfg, 1, vocab_size=64)) == "rollout"


GDPO_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 3), "format_reward": float("+" in solution_str),
            "length_reward": len(solution_str) / 10.0}
"""


def _spied_step(tmp, extra):
    """One step of the tiny config with `extra`; what the advantage estimator was given and gave, the batch before it,
    the metrics."""
    from hybridrl import algos
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.loop import setup_run
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.roles import build_roles

    cfg = load_config(TINY, _overrides(tmp, ["data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2"]
                                       + list(extra)))
    _, tok, layout, groups, loader, _ = setup_run(cfg)
    seen, estimate = {}, algos.compute_advantages

    def spy(name, **kwargs):
        seen["kwargs"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
        seen["advantages"], _ = out = estimate(name, **kwargs)
        return out

    algos.compute_advantages = spy
    try:
        trainer = PPOTrainer(cfg, layout, groups, tok, build_roles(cfg, groups, tok, 4), RewardManager(cfg.reward), None)
        trainer.sync_rollout_weights()
        original = trainer.compute_advantages
        trainer.compute_advantages = lambda batch, scores: (seen.update(batch={k: v.clone() for k, v in batch.items()
                                                                               if torch.is_tensor(v)}),
                                                             original(batch, scores))[1]
        metrics = trainer.train_step(next(iter(loader)), 1)
    finally:
        algos.compute_advantages = estimate
    folder = os.path.join(cfg.trainer.checkpoint_dir, "init_hf")  # the random init the actor was built from
    return dict(seen, metrics=metrics, source=trainer.old_log_prob_source, folder=folder,
                temperature=cfg.rollout.temperature, vocab=trainer.actor.vocab_size)


def test_optimal_token_baseline_reads_the_old_policys_statistics_from_its_own_pass(tmp_path):
    """The estimator gets the old policy's log-probs and sum pi^2 of every response token, equal to those of the
    same weights in transformers (softmax over the true vocabulary at the rollout temperature), from an
    old-log-prob pass of its own; its advantages are the optimal token baseline's of those inputs."""
    from models_helper import hf_logits

    from hybridrl import algos

    run = run_distributed(_spied_step, 1, str(tmp_path), ["algorithm.adv_estimator=optimal_token_baseline"])[0]
    assert run["source"] == "pass" and "timing_s/old_log_prob" in run["metrics"]
    batch, given = run["batch"], run["kwargs"]
    R, mask = batch["responses"].shape[1], batch["response_mask"]
    logits = hf_logits(run["folder"], batch)[:, -R - 1:-1, :run["vocab"]].double() / run["temperature"]
    probs = torch.softmax(logits, dim=-1)
    want_lp = torch.log(probs.gather(-1, batch["responses"][..., None]).squeeze(-1))
    want_sq = probs.square().sum(-1)
    for name, want in (("old_log_probs", want_lp), ("sum_pi_squared", want_sq)):
        torch.testing.assert_close(given[name] * mask, (want * mask).float(), atol=2e-5, rtol=1e-4, msg=name)
    assert given["group_index"] == [i // 4 for i in range(8)]
    want_adv, _ = algos.compute_optimal_token_baseline_advantages(
        given["token_rewards"], given["response_mask"], given["group_index"], want_lp.float(), want_sq.float())
    torch.testing.assert_close(run["advantages"], want_adv, atol=1e-5, rtol=1e-5)
    assert not torch.equal(run["advantages"], algos.compute_advantages(
        "grpo", scores=given["scores"], response_mask=given["response_mask"], group_index=given["group_index"])[0])



@pytest.mark.distributed
def test_gdpo_normalises_each_reward_component_the_reward_function_returned(tmp_path):
    """adv_estimator=gdpo with a custom reward returning two components beside its score: the estimator gets each
    response's values of the keys named (the reward function's own, recomputed here from the decoded responses),
    and the step's advantages are GDPO's of them with the weights given, not GRPO's of the score."""
    from hybridrl import algos
    from hybridrl.tokenizer import load_tokenizer

    reward = tmp_path / "gdpo_reward.py"
    reward.write_text(GDPO_REWARD)
    extra = ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[length_reward,format_reward]",
             "algorithm.gdpo_reward_weights=[0.5,2.0]", f"reward.custom_function.path={reward}"]
    run = run_distributed(_spied_step, 1, str(tmp_path), extra)[0]
    batch, given = run["batch"], run["kwargs"]
    tok = load_tokenizer("builtin:tiny")
    texts = [tok.decode(r[m.bool()].tolist()) for r, m in zip(batch["responses"], batch["attention_mask"][:, -6:])]
    want = [[len(t) / 10.0 for t in texts], [float("+" in t) for t in texts]]
    assert [c.tolist() for c in given["components"]] == [torch.tensor(w).tolist() for w in want]
    assert given["component_weights"] == [0.5, 2.0]
    want_adv, _ = algos.compute_gdpo_advantages([torch.tensor(w) for w in want], given["response_mask"],
                                                given["group_index"], [0.5, 2.0])
    torch.testing.assert_close(run["advantages"], want_adv, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(run["advantages"], algos.compute_advantages(
        "grpo", scores=given["scores"], response_mask=given["response_mask"], group_index=given["group_index"])[0])


def test_a_gdpo_key_the_reward_does_not_return_is_named_with_the_fix():
    from hybridrl.config import AlgorithmConfig
    from hybridrl.trainer.estimator_inputs import RewardComponentError, keep_reward_components

    cfg = AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=["format_reward"])
    batch = {"responses": torch.zeros(2, 3, dtype=torch.long)}
    with pytest.raises(RewardComponentError, match="names 'format_reward'.*its dict keys: \\['acc'\\]"):
        keep_reward_components(batch, {"acc": [1.0, 0.0]}, cfg)
    with pytest.raises(RewardComponentError, match="as a number"):
        keep_reward_components(batch, {"format_reward": [1.0, "yes"]}, cfg)
    keep_reward_components(batch, {"format_reward": [1.0, 0.0]}, cfg)
    assert batch["reward_component/format_reward"].tolist() == [1.0, 0.0]
