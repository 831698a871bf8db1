"""verl's config layout read into hybridrl's: a verl YAML or its dotted overrides (`actor_rollout_ref.actor.*`,
`actor_rollout_ref.rollout.*`, `actor_rollout_ref.ref.*`, `actor_rollout_ref.model.*`, `custom_reward_function.*`)
go to the sections hybridrl has for them (`actor`, `rollout`, `ref`, `model`, `reward.custom_function`); keys
with another home here are named by the error (`MOVED_KEYS`)."""
from __future__ import annotations

import re

from omegaconf import DictConfig, OmegaConf

SECTIONS = {("actor_rollout_ref", "actor"): ("actor",), ("actor_rollout_ref", "rollout"): ("rollout",),
            ("actor_rollout_ref", "ref"): ("ref",), ("actor_rollout_ref", "model"): ("model",),
            ("custom_reward_function",): ("reward", "custom_function")}
"""verl's section path -> hybridrl's."""

_MEGATRON = {f"{role}.megatron.{key}": f"parallel.{key}" for role in ("actor", "ref", "critic")
             for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                         "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                         "use_distributed_optimizer")}
MOVED_KEYS = {"actor.rollout_is_threshold": "algorithm.rollout_correction.rollout_is_threshold (with "
                                            "algorithm.rollout_correction.rollout_is=token)",
              "rollout.val_n": "rollout.val_kwargs.n",
              "rollout.val_temperature": "rollout.val_kwargs.temperature",
              "trainer.max_ckpt_to_keep": "trainer.max_actor_ckpt_to_keep and trainer.max_critic_ckpt_to_keep",
              "rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
              "rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
              "rollout.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz (one switch for the actor's passes)",
              "actor_rollout_ref.hybrid_engine": "placement.mode (colocated, the default, or split)",
              **_MEGATRON}
"""Keys that live elsewhere here (older hybridrl names, verl keys of another section): the error names the new key."""

NOT_READ = {
    "trainer.nnodes": "the world is the launcher's (torchrun --nnodes, SLURM)",
    "trainer.n_gpus_per_node": "the world is the launcher's (torchrun --nproc_per_node, SLURM)",
    "trainer.device": "CUDA where there is one, else the CPU",
    "trainer.ray_wait_register_center_timeout": "no Ray", "trainer.ray_timeline": "no Ray (trainer.timeline_dir)",
    "trainer.esi_redundant_time": "preemption is read from signals and trainer.max_runtime",
    "trainer.del_local_ckpt_after_load": "checkpoints stay where they are",
    "actor.calculate_sum_pi_squared": "sum pi^2 is computed whenever algorithm.adv_estimator reads it "
                                      "(optimal_token_baseline, tir_optimal_token_baseline)",
    "data.return_raw_chat": "each row's raw messages are always kept",
    "data.return_raw_input_ids": "each row's raw messages are always kept",
    "data.return_full_prompt": "each row's raw messages are always kept",
    "data.dataloader_num_workers": "prompts are read in the trainer process",
    "data.validation_shuffle": "validation reads its prompts in file order",
    "actor.strategy": "megatron-core always", "ref.strategy": "megatron-core always",
    "critic.strategy": "megatron-core always",
    "model.trust_remote_code": "configs and tokenizers load without remote code",
    "rollout.mode": "the engine runs in the training processes",
}
"""verl keys with nothing to set here: accepted, named once with why, and dropped."""


def to_hybridrl_sections(layer: DictConfig) -> DictConfig:
    """The layer with verl's sections moved to hybridrl's (merged into what the layer already sets there)."""
    if not any(path[0] in layer for path in SECTIONS):
        return layer
    out = OmegaConf.create(_moved_references(OmegaConf.to_container(layer, resolve=False)))
    for verl_path, ours in SECTIONS.items():
        parent, *rest = verl_path
        node = out.get(parent)
        if rest:
            node = node.get(rest[0]) if isinstance(node, DictConfig) else None
        if node is None:
            continue
        if rest:
            del out[parent][rest[0]]
        else:
            del out[parent]
        target = out
        for part in ours[:-1]:
            if part not in target:
                target[part] = {}
            target = target[part]
        target[ours[-1]] = OmegaConf.merge(target.get(ours[-1], {}), node)
    if "actor_rollout_ref" in out and not len(out["actor_rollout_ref"]):
        del out["actor_rollout_ref"]
    return out


def drop_not_read(layer: DictConfig, dropped: dict) -> DictConfig:
    """The layer without NOT_READ's keys (a key set to null or false is dropped the same); `dropped` gets each."""
    for key, reason in NOT_READ.items():
        section, name = key.split(".")
        if isinstance(layer.get(section), DictConfig) and name in layer[section]:
            del layer[section][name]
            dropped[key] = reason
    return layer


def _moved_references(node):
    """The container with ${...} references to verl's sections pointed at hybridrl's (verl's YAML writes
    `${actor_rollout_ref.actor.ppo_mini_batch_size}` where a value repeats another)."""
    if isinstance(node, dict):
        return {k: _moved_references(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved_references(v) for v in node]
    if isinstance(node, str) and "${" in node:
        for verl_path, ours in SECTIONS.items():
            node = re.sub(r"(\$\{(?:oc\.select:)?)" + re.escape(".".join(verl_path)) + r"(?=[.}:,])",
                          lambda m, to=".".join(ours): m.group(1) + to, node)
    return node
