"""End to end with long-sequence layouts: GRPO at CP 2 and PPO at TP 2 + SP + CP 2 give world 1's first-step
metrics; a checkpoint trained at CP 2 resumes at CP 1 and back, continuing the world-1 run's curve."""
import pytest

from dist_helper import run_distributed
from test_trainer import FIRST_STEP, TINY, _overrides, _torchrun, _train, read_scalars

GRPO = ["algorithm.adv_estimator=grpo"]
LAST = ["trainer.save_freq=1000"]
"""A checkpoint at the run's last step only (save_freq > 0 saves the final step too)."""
GAE_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/values/mean")


def _close(got: dict, want: dict, keys, step: int, tol: float):
    for key in keys:
        assert abs(got[key][step] - want[key][step]) <= tol * max(1.0, abs(want[key][step])), \
            (key, step, got[key][step], want[key][step])


@pytest.fixture(scope="module")
def world1_grpo(tmp_path_factory):
    """Four GRPO steps in one process, padded rows (the reference layout)."""
    tmp = tmp_path_factory.mktemp("w1_grpo")
    run_distributed(_train, 1, TINY, _overrides(tmp, GRPO + ["trainer.total_training_steps=4",
                                                             "model.use_remove_padding=false"]))
    return read_scalars(tmp)


@pytest.mark.slow
def test_grpo_at_cp2_resumes_at_cp1_and_back(tmp_path, world1_grpo):
    run = tmp_path / "run"
    packed = ["model.use_remove_padding=true"]  # tiny_cpu.yaml runs padded rows
    proc = _torchrun(run, 2, GRPO + LAST + packed + ["parallel.context_parallel_size=2", "trainer.total_training_steps=2"])
    assert "cp=2" in proc.stdout and "dp=1" in proc.stdout
    scalars = read_scalars(run)
    _close(scalars, world1_grpo, FIRST_STEP, 1, 1e-5)
    _close(scalars, world1_grpo, ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"), 2, 1e-4)
    run_distributed(_train, 1, TINY, _overrides(run, GRPO + LAST + packed + ["trainer.total_training_steps=3"]))  # CP 1
    proc = _torchrun(run, 2, GRPO + packed + ["parallel.context_parallel_size=2", "trainer.total_training_steps=4"])
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    scalars = read_scalars(run)
    assert set(scalars["actor/pg_loss"]) == {1, 2, 3, 4}
    for step in (3, 4):  # the CP 1 step after the CP 2 checkpoint, then the CP 2 step after the CP 1 one
        _close(scalars, world1_grpo, ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"),
               step, 1e-4)


@pytest.mark.slow
def test_ppo_at_tp2_sp_cp2_on_four_ranks_equals_world1(tmp_path, tmp_path_factory):
    gae = ["algorithm.adv_estimator=gae", "trainer.total_training_steps=1"]
    reference = tmp_path_factory.mktemp("w1_gae")
    run_distributed(_train, 1, TINY, _overrides(reference, gae + ["model.use_remove_padding=false"]))
    proc = _torchrun(tmp_path, 4, gae + ["parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=2",
                                         "model.use_remove_padding=true"],
                     timeout=400)
    assert "tp=2 cp=2" in proc.stdout
    _close(read_scalars(tmp_path), read_scalars(reference), FIRST_STEP + GAE_KEYS, 1, 1e-5)


@pytest.mark.slow
def test_moe_at_tp2_sp_ep2_equals_world1(tmp_path, tmp_path_factory):
    """megatron trains MoE at TP > 1 only with sequence parallelism: TP 2 x EP 2 on four ranks, experts split
    over TP and EP, gives world 1's first step."""
    moe = ["model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_intermediate_size=32",
           "trainer.total_training_steps=1"]
    reference = tmp_path_factory.mktemp("w1_moe")
    run_distributed(_train, 1, TINY, _overrides(reference, moe))
    proc = _torchrun(tmp_path, 4, moe + ["parallel.tensor_model_parallel_size=2",
                                         "parallel.expert_model_parallel_size=2"], timeout=400)
    assert "tp=2 pp=1 dp=2 ep=2" in proc.stdout
    _close(read_scalars(tmp_path), read_scalars(reference), FIRST_STEP, 1, 1e-5)
