"""The RL trainer on a tiny Qwen3-MoE: 3 steps at expert parallel 2 (torchrun, two processes) with routing replay, whose
first step equals the single-process run's (GRPO with a KL loss against the reference; PPO with a critic whose
value head sits on the MoE trunk), and the MoE metrics with the engine-vs-trainer log-prob agreement."""
import pytest

from dist_helper import run_distributed
from test_trainer import TINY, _overrides, _torchrun, _train, read_scalars

MOE = ["model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_topk=2", "model.moe_intermediate_size=32",
       "actor.router_replay=rollout", "trainer.total_training_steps=3", "trainer.logger=[console,tensorboard]"]
ESTIMATORS = {"grpo": ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true"], "gae": ["algorithm.adv_estimator=gae"]}
KEYS = {"grpo": ["actor/kl_loss"], "gae": ["critic/vf_loss", "critic/grad_norm", "critic/values/mean"]}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_ep2_and_pp2_first_step_equals_ep1(tmp_path, estimator):
    run_distributed(_train, 1, TINY, _overrides(tmp_path / "ep1", MOE + ESTIMATORS[estimator]))
    _torchrun(tmp_path / "ep2", 2, MOE + ESTIMATORS[estimator] + ["parallel.expert_model_parallel_size=2"])
    one = read_scalars(tmp_path / "ep1")
    if estimator == "grpo":  # PP 2: the routes are broadcast to the other stage with the rollout
        _torchrun(tmp_path / "pp2", 2, MOE + ESTIMATORS[estimator] + ["parallel.pipeline_model_parallel_size=2"])
        _same_first_step(one, read_scalars(tmp_path / "pp2"), estimator)
    _same_first_step(one, read_scalars(tmp_path / "ep2"), estimator)


def _same_first_step(one, two, estimator):
    assert 1.0 <= one["actor/moe_load_imbalance"][1] <= 2.0  # max over mean tokens per expert: 1 balanced, E/k = 2 at most
    assert 1.0 <= one["actor/moe_aux_loss"][1] <= 2.0  # 1 when balanced, E/k = 2 when two experts take everything
    # replay: the trainer's forward of the engine's tokens takes the engine's experts, so only rounding is left
    assert one["rollout/logprob_diff_mean"][1] < 1e-4
    for key in ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "actor/entropy", "actor/moe_aux_loss",
                "actor/moe_load_imbalance", "rollout/logprob_diff_mean"] + KEYS[estimator]:
        a, b = one[key][1], two[key][1]
        tol = 1e-6 if key == "rollout/logprob_diff_mean" else 1e-5 * max(1.0, abs(a))
        assert abs(a - b) <= tol, (key, a, b)


def _train_with_shifted_routes(config_path, overrides):
    """The trainer, with the engine reporting each token's experts shifted by one: if the actor's forwards
    use the reported routes, its log-probs stop agreeing with the engine's."""
    from hybridrl.rollout.native import NativeEngine

    generate = NativeEngine.generate

    def shifted(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        out.routed_experts = (out.routed_experts + 1) % self.spec.num_experts
        return out

    NativeEngine.generate = shifted
    return _train(config_path, overrides)


@pytest.mark.slow
def test_the_actor_uses_the_engines_routes(tmp_path):
    run_distributed(_train_with_shifted_routes, 1, TINY, _overrides(tmp_path, MOE + [
        "trainer.total_training_steps=1", "algorithm.adv_estimator=grpo"]))
    assert read_scalars(tmp_path)["rollout/logprob_diff_mean"][1] > 1e-3  # against ~1e-7 with the true routes


@pytest.mark.slow
def test_split_placement_carries_the_routes(tmp_path):
    """Two trainer ranks at EP 2 (both walk the weight stream: each holds half of the experts) and a rollout rank
    of its own, one step off-policy: the routes come back with the responses, joined across chunks."""
    _torchrun(tmp_path, 3, MOE + ["algorithm.adv_estimator=grpo", "parallel.expert_model_parallel_size=2",
                                  "placement.mode=split", "placement.rollout_world_size=1",
                                  "async_training.staleness_threshold=1"])
    diff = read_scalars(tmp_path)["rollout/logprob_diff_mean"]
    assert diff[1] < 1e-4 and len(diff) == 3  # the first batch comes from the initial weights, replayed exactly
