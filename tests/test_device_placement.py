"""Device placement without a GPU: one trainer step on an emulated accelerator (tests/virtual_device.py).

The run's device is VIRTUAL and the actor, critic and reference live on it (`on_device`, the
emulated `.cuda()`); `torch.cuda.current_device()` and literal "cuda" devices mean VIRTUAL too, as
they mean the GPU on a CUDA machine. Then `PPOTrainer.sync_rollout_weights`, `generate`,
`validate` and a whole `train_step` run with real values, and any torch call that mixes a host
tensor (one or more dimensions) into device work, or any torch.distributed tensor collective on a
host tensor, fails the test.

Covered, for the layouts below (DP=2 with a critic, reference, reward model and offloaded actor;
TP=2): prompt and rollout batches placed where they are assembled, the rollout broadcast over the
model replica, rule rewards and reward-model scores (offloaded, added to the rule's), old/ref
log-probs, values, KL, advantages with their DP gathers, mini/micro-batch splits, losses and DP
loss normalisation, megatron's schedule, DDP gradient reduction and the optimizer, the
weight stream into the rollout engine (up to `load_weights`), offload/onload, and the metrics.
Not covered: the inside of the rollout engine (`generate`, `load_weights`, `sleep`, `wake_up` run as
host code here: the native engine keeps its own device), kernels that C++ runs internally
(backward, gloo), and CUDA-only branches (megatron's optimizer, pinned host memory).
"""
import dataclasses
import functools
import os

import pytest
import torch

from dist_helper import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
SMALL = ["data.train_batch_size=4", "rollout.n=2", "data.max_response_length=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
         "data.val_batch_size=4", "trainer.progress_bar=false", "model.num_layers=2"]


def _host_side(fn):
    from virtual_device import without_check

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with without_check():
            return fn(*args, **kwargs)
    return run


def _build(overrides):
    import torch.distributed as dist

    from virtual_device import VIRTUAL, on_device

    from hybridrl.config.io import load_config
    from hybridrl.data.prompts import make_train_loader, make_val_loader
    from hybridrl.data.synthetic import ensure_synthetic_data
    from hybridrl.config.layout import derive_layout
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles
    from hybridrl.tokenizer import load_tokenizer
    from hybridrl.trainer.ppo import PPOTrainer

    cfg = load_config(TINY, overrides)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    layout = derive_layout(cfg, dist.get_world_size(), tokenizer.vocab_size)
    groups = dataclasses.replace(init_model_parallel(layout.tp, layout.pp, seed=cfg.trainer.seed, ep=layout.ep,
                                                       cp=layout.cp), device=VIRTUAL)
    if dist.get_rank() == 0:
        ensure_synthetic_data(cfg.data)
    dist.barrier()
    roles = build_roles(cfg, groups, tokenizer, total_steps=2)
    for worker in (roles.actor, roles.critic, roles.ref, roles.reward_model):
        if worker is not None:
            on_device(worker.engine.module)
    for name in ("generate", "load_weights", "sleep", "wake_up"):
        setattr(roles.rollout, name, _host_side(getattr(roles.rollout, name)))
    trainer = PPOTrainer(cfg, layout, groups, tokenizer, roles, RewardManager(cfg.reward), writer=None)
    loaders = (make_train_loader(cfg.data, tokenizer, groups.dp_rank, groups.dp),
               make_val_loader(cfg.data, tokenizer, groups.dp_rank, groups.dp))
    return trainer, loaders


def _step_on_virtual_device(overrides):
    from virtual_device import DeviceMixError, OnDevice, virtual_device

    import hybridrl.trainer.ppo as trainer_module
    from hybridrl.config.batching import MicroBatching

    with virtual_device():
        trainer, (train_loader, val_loader) = _build(overrides)
        trainer.sync_rollout_weights()
        prompts = next(iter(train_loader))
        batch = trainer.generate(prompts, trainer.train_sampling(), step=1)
        placed = sorted(k for k, v in batch.items() if isinstance(v, OnDevice))
        metrics = trainer.train_step(prompts, step=1)
        val = trainer.validate(val_loader)
        # the defect this guards against: a batch assembled on the host is fed to the device model
        original = trainer_module.assemble
        trainer_module.assemble = lambda *args: original(*args[:5], "cpu")
        try:
            host_batch = trainer.generate(prompts, trainer.train_sampling(), step=1)
            trainer.actor.compute_log_prob(host_batch, MicroBatching(2))
            caught = None
        except DeviceMixError as err:
            caught = str(err)
        finally:
            trainer_module.assemble = original
    return dict(placed=placed, keys=sorted(batch), metrics=metrics, val=val, caught=caught)


def _paths(tmp):
    return [f"data.train_files=[{tmp}/data/train.parquet]", f"data.val_files=[{tmp}/data/test.parquet]",
            f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/tb"]


def _check(results):
    for r in results:
        assert r["placed"] == r["keys"], f"batch tensors left on the host: {set(r['keys']) - set(r['placed'])}"
        assert "actor/pg_loss" in r["metrics"] and torch.isfinite(torch.tensor(r["metrics"]["actor/pg_loss"]))
        assert 0 < r["metrics"]["timing_s/generate_sequences"] <= r["metrics"]["timing_s/gen"]  # nested stage
        assert any(k.startswith("val-core/") for k in r["val"])
        assert r["caught"] is not None and "host tensors" in r["caught"], r["caught"]


@pytest.mark.distributed
def test_one_step_dp2_with_critic_reference_reward_model_and_offload(tmp_path):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    rm = random_hf_model_folder(str(tmp_path / "rm"), "qwen2", seed=5, head="score", num_hidden_layers=1)
    overrides = SMALL + _paths(tmp_path) + [
        "algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
        "actor.offload.params=true", "actor.offload.grads=true", "actor.offload.optimizer=true",
        "ref.offload_params=true", "rollout.free_cache_engine=true", "reward_model.enable=true",
        f"reward_model.path={rm}", "reward_model.offload_params=true", "reward_model.combine=add",
        "reward_model.micro_batch_size_per_gpu=2"]
    results = run_distributed(_step_on_virtual_device, 2, overrides, timeout=300)
    _check(results)
    assert all("critic/rm_score/mean" in r["metrics"] for r in results)  # the reward model did score


@pytest.mark.distributed
def test_one_step_tp2_rollout_broadcast(tmp_path):
    overrides = SMALL + _paths(tmp_path) + ["algorithm.adv_estimator=grpo", "parallel.tensor_model_parallel_size=2"]
    _check(run_distributed(_step_on_virtual_device, 2, overrides, timeout=300))


def test_the_check_itself():
    import torch.distributed as dist

    from virtual_device import VIRTUAL, DeviceMixError, OnDevice, virtual_device

    with virtual_device():
        dev = torch.ones(2, 3, device="cuda")
        assert isinstance(dev, OnDevice) and dev.device == VIRTUAL
        assert isinstance(torch.zeros(3, device=dev.device) + dev, OnDevice)
        assert isinstance(dev * torch.tensor(2.0), OnDevice)  # a 0-dim host scalar is fine, as on CUDA
        assert type(dev.cpu()) is torch.Tensor and dev.sum().item() == 6.0
        with pytest.raises(DeviceMixError, match="host tensors"):
            dev + torch.ones(3)
        with pytest.raises(DeviceMixError, match="host tensors"):
            torch.cat([dev, torch.ones(1, 3)])
        with pytest.raises(DeviceMixError):
            torch.zeros(2, 3).add_(dev)
        with pytest.raises(DeviceMixError, match="numpy"):
            dev.numpy()
        with pytest.raises(DeviceMixError, match="nccl"):
            dist.all_reduce(torch.ones(2))


def test_host_blocks_keep_their_own_megatron_scratch():
    """megatron's process-wide scratch pool: a buffer that host-run code allocated is never handed to
    device work (on a real accelerator both allocate on the device); a genuine host tensor still trips."""
    from megatron.core import parallel_state

    from virtual_device import DeviceMixError, is_on_device, virtual_device, without_check

    from hybridrl.parallel import cpu_compat

    cpu_compat.apply()
    parallel_state._set_global_memory_buffer()
    try:
        with virtual_device():
            with without_check():  # e.g. a rollout on megatron's forward, at a wider shape
                host = parallel_state.get_global_memory_buffer().get_tensor((4, 8, 8), torch.float32, "mpu")
            dev = parallel_state.get_global_memory_buffer().get_tensor((2, 8, 8), torch.float32, "mpu")
            assert not is_on_device(host) and is_on_device(dev)
            q = torch.ones(2, 8, 8, device="cuda")
            assert is_on_device(torch.baddbmm(dev, q, q))
            with pytest.raises(DeviceMixError, match="host tensors"):
                torch.baddbmm(host[:2], q, q)
    finally:
        parallel_state.destroy_global_memory_buffer()
