"""Build the roles of a run: actor, reference, critic (PPO only), reward model (optional), rollout engine.

Every role loads from one HF folder (model.path, or a seeded random model written once when the
config builds a tiny model from its fields), so all roles start from the same weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hybridrl.config import Config, ConfigError, OffloadConfig
from hybridrl.placement.offload import Offloader
from hybridrl.models.gpt import GPTSpec
from hybridrl.parallel.cpu_compat import cuda_to_cpu
from hybridrl.parallel.distributed import ParallelGroups
from hybridrl.workers.actor import ActorWorker, LogProbWorker
from hybridrl.workers.critic import CriticWorker
from hybridrl.workers.engine import ModelEngine
from hybridrl.workers.optim import build_optimizer


@dataclass
class Roles:
    spec: GPTSpec
    hf_folder: str
    actor: ActorWorker
    ref: Optional[LogProbWorker]
    critic: Optional[CriticWorker]
    rollout: object
    reward_model: Optional[object] = None
    """workers.reward_model.RewardModelWorker when reward_model.enable."""


def init_model_folder(cfg: Config, vocab_size: int) -> str:
    """model.path, or a random HF model built from the config fields (written by rank 0).

    The folder records the fields it was built from (INIT_RECORD); a run whose model fields or seed
    differ rebuilds it instead of silently starting from a stale init.
    """
    if cfg.model.path:
        return cfg.model.path
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    m = cfg.model
    folder = os.path.join(cfg.trainer.checkpoint_dir, "init_hf")
    fields = dict(seed=m.seed, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_key_value_heads, vocab_size=m.vocab_size or vocab_size,
                  max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
                  rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=m.tie_word_embeddings, initializer_range=0.02)
    fields.update(_family_fields(m))
    record = {"architecture": m.architecture, **fields}
    record_path = os.path.join(folder, INIT_RECORD)
    if dist.get_rank() == 0 and _read_json(record_path) != record:
        shutil.rmtree(folder, ignore_errors=True)
        kept = _kept_init(record)
        if kept and os.path.isfile(os.path.join(kept, INIT_RECORD)):
            shutil.copytree(kept, folder)
        else:
            random_hf_model_folder(folder, m.architecture, **fields)
            with open(record_path, "w") as f:
                json.dump(record, f, indent=1)
            _keep_init(folder, kept)
    dist.barrier()
    return folder


INIT_CACHE_ENV = "HYBRIDRL_INIT_CACHE"
"""A folder where random init folders are kept by record: a run whose record was built before copies that build
instead of building it again (the build imports transformers' modeling code, a second or more per run start).
Unset (the default), every run builds its own; the test suite sets it."""


def _kept_init(record: dict) -> str | None:
    """Where $HYBRIDRL_INIT_CACHE keeps the build of `record` (with the torch and transformers versions that
    decide its random values), or None when unset."""
    import hashlib
    from importlib.metadata import version

    cache = os.environ.get(INIT_CACHE_ENV, "")
    if not cache:
        return None
    key = json.dumps([record, torch.__version__, version("transformers")], sort_keys=True)
    return os.path.join(os.path.expanduser(cache), hashlib.sha256(key.encode()).hexdigest()[:24])


def _keep_init(folder: str, kept: str | None) -> None:
    """Copy a fresh build to its cache place, whole or not at all (another process may be keeping the same one)."""
    if not kept:
        return
    tmp = f"{kept}.{os.getpid()}.tmp"
    try:
        shutil.copytree(folder, tmp)
        os.rename(tmp, kept)
    except OSError:  # kept meanwhile by another run, or the cache is not writable: this run has its own build
        shutil.rmtree(tmp, ignore_errors=True)


INIT_RECORD = "hybridrl_init.json"


def _family_fields(m) -> dict:
    """Config fields only some families have: Qwen3's explicit head_dim, the experts of the MoE ones."""
    qwen3 = m.architecture.startswith("qwen3")
    out = {"head_dim": m.head_dim or m.hidden_size // m.num_attention_heads} if qwen3 else {}
    if m.architecture == "qwen3_moe":
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.moe_topk, norm_topk_prob=m.norm_topk_prob,
                   moe_intermediate_size=m.moe_intermediate_size)
    elif m.architecture == "mixtral":  # Mixtral's intermediate_size is the size of one expert
        out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.moe_topk,
                   intermediate_size=m.moe_intermediate_size)
    return out


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sequence_overrides(cfg: Config, groups: ParallelGroups) -> dict:
    """How every trained or scoring model lays out its sequences (`build_gpt`): sequence parallelism at TP > 1
    (parallel.sequence_parallel), packed rows (model.use_remove_padding), the context parallel size of `groups`."""
    return {"sequence_parallel": cfg.parallel.sequence_parallel_at(groups.tp),
            "remove_padding": cfg.model.use_remove_padding, "context_parallel_size": groups.cp}


def training_overrides(cfg: Config, groups: ParallelGroups) -> dict:
    """TransformerConfig fields of the trainable roles: the sequence layout, and full activation
    recomputation on request."""
    out = sequence_overrides(cfg, groups)
    if cfg.parallel.recompute_activations:
        out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return out


def actor_moe_overrides(cfg: Config) -> dict:
    """The actor's MoE TransformerConfig fields (a dense model ignores them): the load-balancing loss
    weight, and megatron's routing replay when the trainer replays the rollout's expert choices."""
    out = {"moe_aux_loss_coeff": cfg.actor.moe_aux_loss_coeff}
    if cfg.actor.router_replay == "rollout":
        out["moe_enable_routing_replay"] = True
    return out


def wrap_trainable(module, cfg: Config):
    """Wrap a role's model in megatron DDP (gradient buffers, DP all-reduce in finalize_model_grads);
    shared by the RL, SFT and reward-model trainers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    config = module.config
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    with cuda_to_cpu():
        return DistributedDataParallel(config, ddp_config, module)


def _frozen(module):
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


def build_rollout(cfg: Config, spec: GPTSpec, groups: ParallelGroups, tokenizer):
    # the engines keep their own copy on the local layer spec: the native decode reads its raw
    # weights, vLLM only needs the HF architecture; both receive HF-named tensors
    spec = dataclasses.replace(spec, layer_spec="local")
    if cfg.rollout.name == "vllm":
        from hybridrl.rollout.vllm import VLLMEngine

        longest = cfg.data.max_prompt_length + cfg.data.max_response_length  # verl's max_model_len
        if longest > spec.max_position_embeddings:
            raise ConfigError(f"data.max_prompt_length + data.max_response_length = {longest} is more than the "
                              f"model's max_position_embeddings ({spec.max_position_embeddings}); shorten them")
        return VLLMEngine(spec=spec, cfg=cfg.rollout, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_ids,
                          max_model_len=longest)
    from hybridrl.rollout.native import NativeEngine

    return NativeEngine(spec, cfg.rollout.tensor_model_parallel_size, groups, cfg.model.params_dtype,
                        tokenizer.pad_token_id, tokenizer.eos_token_id, max_num_seqs=cfg.rollout.max_num_seqs,
                        enforce_eager=cfg.rollout.enforce_eager, record_routes=cfg.actor.router_replay == "rollout")


@contextlib.contextmanager
def training_state_offloaded(modules_and_optimizers):
    """Everything of the trainable roles on the host (and torch's cache emptied) inside the block:
    vLLM's worker starts only with gpu_memory_utilization x total memory free."""
    offloaders = [Offloader(m, o, OffloadConfig(params=True, grads=True, optimizer=True))
                  for m, o in modules_and_optimizers]
    for offloader in offloaders:
        offloader.offload()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        yield
    finally:
        for offloader in offloaders:
            offloader.onload()


def build_critic_worker(cfg: Config, groups: ParallelGroups, folder: str, total_steps: int) -> CriticWorker:
    """The critic (value head on the HF trunk, seeded) with its optimizer, on `groups`."""
    from hybridrl.models.critic import critic_from_hf

    critic_model, _, _ = critic_from_hf(cfg.critic.path or folder, groups, cfg.model.params_dtype, seed=cfg.model.seed,
                                        **training_overrides(cfg, groups))
    critic_module = wrap_trainable(critic_model, cfg)
    critic_opt = build_optimizer(critic_module, cfg.critic.optim, groups, total_steps,
                                 cfg.parallel.use_distributed_optimizer, critic_model.config.params_dtype)
    return CriticWorker(ModelEngine(critic_module, groups), critic_opt, cfg.critic, cfg.data.max_response_length,
                        cfg.algorithm.gamma, cfg.algorithm.lam)


def build_roles(cfg: Config, groups: ParallelGroups, tokenizer, total_steps: int, with_engine: bool = True,
                with_critic: bool = True) -> Roles:
    """Every role of a run on `groups`; without the rollout engine (`with_engine` False) when other
    ranks generate, and without the critic (`with_critic` False) when it has ranks of its own."""
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.models.lora import apply_lora
    from hybridrl.workers.lora_reference import BaseReference

    folder = init_model_folder(cfg, tokenizer.vocab_size)
    dtype = cfg.model.params_dtype
    temperature = cfg.rollout.temperature
    recompute = training_overrides(cfg, groups)
    lora = cfg.actor.lora
    actor_model, spec = model_from_hf(folder, groups, dtype, **recompute, **actor_moe_overrides(cfg),
                                      **({"layer_spec": "local"} if lora.enabled else {}))
    if lora.enabled:  # before DDP: the frozen base gets no gradient buffer, the optimizer only the adapters
        apply_lora(actor_model, lora, spec, groups.pp, groups.pp_rank, seed=cfg.model.seed, base=folder)
    actor_module = wrap_trainable(actor_model, cfg)
    actor_opt = build_optimizer(actor_module, cfg.actor.optim, groups, total_steps,
                                cfg.parallel.use_distributed_optimizer, actor_model.config.params_dtype)
    actor = ActorWorker(ModelEngine(actor_module, groups), actor_opt, cfg.actor, spec.vocab_size, temperature,
                        cfg.data.max_response_length)
    ref = None
    if lora.enabled and (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        ref = BaseReference(actor.engine, spec.vocab_size, temperature)  # the base: adapters off
    elif cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        ref_model, _ = model_from_hf(folder, groups, dtype, **sequence_overrides(cfg, groups))
        ref = LogProbWorker(ModelEngine(_frozen(ref_model), groups), spec.vocab_size, temperature)
        ref.offloader = Offloader(ref_model, None, OffloadConfig(params=cfg.ref.offload_params))
        ref.offloader.offload()  # ref.offload_params: on the host except in its own phase
    critic = build_critic_worker(cfg, groups, folder, total_steps) if with_critic and cfg.algorithm.uses_critic else None
    owners = [(w.engine.module, w.optimizer.optimizer) for w in (actor, critic) if w is not None]
    owners += [(ref.engine.module, None)] if ref is not None and ref.engine is not actor.engine else []
    rollout = None
    if with_engine:
        with training_state_offloaded(owners) if cfg.rollout.name == "vllm" else contextlib.nullcontext():
            rollout = build_rollout(cfg, spec, groups, tokenizer)
    reward_model = build_reward_model(cfg, groups, tokenizer) if cfg.reward_model.enable else None
    return Roles(spec, folder, actor, ref, critic, rollout, reward_model)


def build_reward_model(cfg: Config, groups: ParallelGroups, tokenizer):
    """The frozen reward model at the training TP/PP, re-encoding for its own tokenizer when it has one."""
    from hybridrl.models.critic import check_reward_head, reward_model_from_hf
    from hybridrl.workers.reward_model import RewardModelWorker, build_reencoder, check_vocab

    rm = cfg.reward_model
    if not os.path.isfile(os.path.join(rm.path, "config.json")):
        raise ConfigError(f"reward_model.path='{rm.path}' has no config.json; train one with scripts/train_rm.py "
                          "--config <this config>, or point it at an HF *ForSequenceClassification folder")
    check_reward_head(rm.path)
    model, spec, pad_id = reward_model_from_hf(rm.path, groups, cfg.model.params_dtype, **sequence_overrides(cfg, groups))
    reencoder = build_reencoder(cfg, pad_id)
    if spec.is_moe and groups.ep > 1 and reencoder is not None:
        raise ConfigError("an MoE reward model with its own tokenizer scores sequences of a different length on "
                          "each rank, but expert-parallel ranks must forward in lockstep; use a reward model that "
                          "shares the policy's tokenizer, a dense one, or parallel.expert_model_parallel_size=1")
    rm_tokenizer = reencoder.tokenizer if reencoder is not None else tokenizer
    check_vocab(rm_tokenizer, spec.vocab_size)
    worker = RewardModelWorker(ModelEngine(_frozen(model), groups), pad_id, rm.micro_batch_size_per_gpu, reencoder)
    if rm.offload_params:
        worker.offloader = Offloader(model, None, OffloadConfig(params=True))
        worker.offloader.offload()
    return worker
