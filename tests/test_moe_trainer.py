"""The RL trainer on a tiny Qwen3-MoE: 3 steps at expert parallel 2 (torchrun, two processes) with routing replay, whose
first step equals the single-process run's (GRPO with a KL loss against the reference; PPO with a critic whose
value head sits on the MoE trunk), and the MoE metrics with the engine-vs-trainer log-prob agreement."""
import os

import pytest
import torch

from dist_helper import run_distributed
from shifted_routes import shift_routes
from test_split_data_paths import bytes_by_stream
from test_split_placement import _hf_weights
from test_trainer import TINY, _overrides, _torchrun, _train, read_scalars

PATCHED_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patched_run.py")

MOE = ["model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_topk=2", "model.moe_intermediate_size=32",
       "actor.router_replay=rollout", "trainer.total_training_steps=3", "trainer.logger=[console,tensorboard]"]
ESTIMATORS = {"grpo": ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true"], "gae": ["algorithm.adv_estimator=gae"]}
KEYS = {"grpo": ["actor/kl_loss"], "gae": ["critic/vf_loss", "critic/grad_norm", "critic/values/mean"]}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_ep2_and_pp2_first_step_equals_ep1(tmp_path, estimator):
    """EP 2 equals EP 1 at step 1 and in the weights exported after 3 updates (the experts' updates show from
    step 2 on only). PP 2 (the routes are broadcast to the other stage with the rollout) equals EP 1 at step 1;
    there the engine reports shifted routes for batch 2 only, and the disagreement jumps at that step alone."""
    export = lambda run: [f"trainer.export_hf_dir={tmp_path / run}/hf"]
    run_distributed(_train, 1, TINY, _overrides(tmp_path / "ep1", MOE + ESTIMATORS[estimator] + export("ep1")))
    run_distributed(_train, 2, TINY, _overrides(tmp_path / "ep2", MOE + ESTIMATORS[estimator] + [
        "parallel.expert_model_parallel_size=2"] + export("ep2")))
    one = read_scalars(tmp_path / "ep1")
    if estimator == "grpo":
        run_distributed(_train_shifting, 2, {2}, TINY, _overrides(tmp_path / "pp2", MOE + ESTIMATORS[estimator] + [
            "parallel.pipeline_model_parallel_size=2"]))
        pp2 = read_scalars(tmp_path / "pp2")
        _same_first_step(one, pp2, estimator)
        diff = pp2["rollout/logprob_diff_mean"]
        assert diff[2] > 1e-3 and diff[3] < 1e-4, diff  # 7e-3 against ~1e-7 with the true routes
    _same_first_step(one, read_scalars(tmp_path / "ep2"), estimator)
    a, b = _hf_weights(tmp_path / "ep1" / "hf"), _hf_weights(tmp_path / "ep2" / "hf")
    assert a.keys() == b.keys() and any(".experts." in name for name in a)
    for name in a:  # 7e-7 apart on one CPU, 1.2e-6 on another; an update (lr 1e-3) moves a weight by up to 1e-3
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=5e-6, msg=name)


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


def _train_shifting(calls: set, config_path, overrides):
    """The trainer, with the engine reporting each token's experts shifted by one on its generate calls `calls`
    (1-based, per process): if the actor's forwards use the reported routes, its log-probs stop agreeing with
    the engine's on those batches."""
    shift_routes(calls)
    return _train(config_path, overrides)


@pytest.mark.slow
def test_the_actor_uses_the_engines_routes(tmp_path):
    run_distributed(_train_shifting, 1, {1}, TINY, _overrides(tmp_path, MOE + [
        "trainer.total_training_steps=1", "algorithm.adv_estimator=grpo"]))
    assert read_scalars(tmp_path)["rollout/logprob_diff_mean"][1] > 1e-3  # against ~1e-7 with the true routes


@pytest.mark.slow
def test_split_placement_carries_the_routes(tmp_path):
    """Two trainer ranks at EP 2 (both walk the weight stream: each holds half of the experts) and a rollout rank
    of its own, one step off-policy: the routes come back with the responses, joined across chunks. The engine
    reports the first batch's routes shifted by one: that batch comes from the initial weights, so only the
    routes can make the trainer disagree with the engine (1e-7 with the true ones, as EP 1 at step 1; later
    batches are a version old, which alone gives ~2e-2). The weights: each EP rank sends the experts it holds
    (EP rank 0 everything else too), each over a bridge of its own: the larger stream is by hand the dense
    tensors and experts 0-1, the two together every HF tensor once."""
    _torchrun(tmp_path, 3, MOE + ["algorithm.adv_estimator=grpo", "parallel.expert_model_parallel_size=2",
                                  "placement.mode=split", "placement.rollout_world_size=1",
                                  "async_training.staleness_threshold=1", f"trainer.export_hf_dir={tmp_path}/hf"],
              script=PATCHED_RUN, env={"SHIFT_ROUTES_ON": "1"})
    scalars = read_scalars(tmp_path)
    diff = scalars["rollout/logprob_diff_mean"]
    assert diff[1] > 1e-3 and len(diff) == 3, diff
    streams = bytes_by_stream(_hf_weights(tmp_path / "hf"), 2, 1, 4, 2)
    assert set(streams) == {(0, 0), (0, 1)} and streams[(0, 0)] > streams[(0, 1)]
    assert set(scalars["perf/weight_sync_bytes"].values()) == {0.0, sum(streams.values())}
    assert set(scalars["perf/weight_sync_sender_max_bytes"].values()) == {streams[(0, 0)]}
