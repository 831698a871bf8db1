"""Critic: the GPT trunk with a scalar value head instead of the LM head; forward gives values [B, S] fp32.

The head is a replicated `Linear(hidden, 1)` placed at `GPTModel.output_layer`, so megatron's own
forward and pipeline schedule drive it unchanged (only the last stage has it). Replication is
sound because every TP rank computes the same values: without sequence parallelism each holds the
full hidden states after the final norm; with it, each computes the values of its slice of the
sequence and the slices are all-gathered over TP (backward: each rank keeps its slice's gradient),
so the head's gradients are partial sums, all-reduced over TP like megatron's norm weights. Initialisation:
from an HF causal LM (lm_head dropped, head seeded identically on every rank), or from a reward
model (`score.weight` [1, H] of HF `*ForSequenceClassification`, or TRL's `v_head.summary.*`).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrl.models.gpt import GPTSpec, build_gpt, for_this_machine
from hybridrl.models.hf_checkpoint import (CheckpointMismatchError, SafetensorsReader, load_hf_into_mcore,
                                           mcore_to_hf_stream, sample_weight, unwrap_model)
from hybridrl.models.hf_config import as_config_dict, check_parallel_layout, spec_from_hf_config

# reward-model head names -> (weight, bias or None), in order of preference
REWARD_HEADS = (("score.weight", "score.bias"), ("v_head.summary.weight", "v_head.summary.bias"),
                ("v_head.weight", "v_head.bias"))
HEAD_WEIGHT, HEAD_BIAS = "output_layer.value_head.weight", "output_layer.value_head.bias"
SEQ_CLS_ARCHITECTURES = {"qwen2": "Qwen2ForSequenceClassification", "llama": "LlamaForSequenceClassification",
                         "qwen3": "Qwen3ForSequenceClassification", "qwen3_moe": "Qwen3MoeForSequenceClassification",
                         "mixtral": "MixtralForSequenceClassification"}


class ValueHead(torch.nn.Module):
    """Replicated Linear(hidden, 1) with the output-layer call signature megatron's GPTModel uses."""

    def __init__(self, hidden_size: int, dtype=torch.float32, seed: int = 0, std: float = 0.02,
                 sequence_parallel_group=None):
        super().__init__()
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        g = torch.Generator().manual_seed(seed)  # same seed on every rank keeps TP replicas equal
        with torch.no_grad():
            self.value_head.weight.copy_(std * torch.randn(1, hidden_size, generator=g))
            self.value_head.bias.zero_()
        self.sequence_parallel_group = sequence_parallel_group
        """The TP group when the hidden states arrive split along the sequence (sequence parallelism)."""
        for p in self.value_head.parameters():
            p.sequence_parallel = sequence_parallel_group is not None

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # [S, B, H] -> [S, B] in fp32; GPTModel transposes the result to [B, S]
        w, b = self.value_head.weight.float(), self.value_head.bias.float()
        values = F.linear(hidden_states.float(), w, b).squeeze(-1)
        if self.sequence_parallel_group is not None:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.sequence_parallel_group)
        return values, None


def build_critic(spec: GPTSpec, tp: int, pp: int, pp_rank: int, dtype: str = "float32", seed: int = 0,
                 ep: int = 1, **config_overrides):
    """A GPTModel chunk whose last stage ends in a ValueHead (untied: the critic has no LM head)."""
    trunk_spec = dataclasses.replace(spec, tie_word_embeddings=False)
    model = build_gpt(trunk_spec, tp, pp, pp_rank, dtype, ep, **config_overrides)
    if model.post_process:
        sp_group = model.pg_collection.tp if model.config.sequence_parallel else None
        head = ValueHead(spec.hidden_size, model.config.params_dtype, seed, model.config.init_method_std, sp_group)
        model.output_layer = head.to(next(model.parameters()).device)
    return model


def critic_sharded_state_dict(model, metadata=None) -> dict:
    """megatron's sharded state dict of a critic chunk. LanguageModule expects an LM head at
    `output_layer.weight` on the last stage; the value head is a plain replicated module there, so
    the chunk is described as a non-final stage would be, plus the head as replicated tensors."""
    post_process, model.post_process = model.post_process, False
    try:
        return model.sharded_state_dict(metadata=metadata)
    finally:
        model.post_process = post_process


def load_value_head(model, reader) -> str | None:
    """Copy a reward model's head into the critic's ValueHead; returns the HF name used, or None."""
    names = set(reader.names())
    for w_name, b_name in REWARD_HEADS:
        if w_name not in names:
            continue
        head = model.output_layer.value_head
        w = reader.read(w_name)
        if tuple(w.shape) != tuple(head.weight.shape):
            raise ValueError(f"reward head {w_name!r} has shape {list(w.shape)}, expected shape "
                             f"{list(head.weight.shape)} (a single-label value head)")
        with torch.no_grad():
            head.weight.copy_(w)
            head.bias.copy_(reader.read(b_name).reshape(1) if b_name in names else torch.zeros(1))
        return w_name
    return None


def critic_from_hf(hf_folder_or_config, groups, dtype: str = "float32", seed: int = 0, **config_overrides):
    """(critic, spec, head_source): the trunk from an HF LM or reward-model folder.

    head_source is the reward head's HF name when the folder had one (then it initialises the
    value head), else None (fresh seeded head).
    """
    cfg = as_config_dict(hf_folder_or_config)
    spec = for_this_machine(spec_from_hf_config(cfg))
    check_parallel_layout(spec, groups.tp, groups.pp, groups.ep)
    model = build_critic(spec, groups.tp, groups.pp, groups.pp_rank, dtype, seed, groups.ep, **config_overrides)
    if not (isinstance(hf_folder_or_config, (str, os.PathLike)) and os.path.isdir(hf_folder_or_config)):
        return model, spec, None
    folder = os.fspath(hf_folder_or_config)
    allowed = {"lm_head.weight"} | {n for pair in REWARD_HEADS for n in pair}
    load_hf_into_mcore(model, folder, spec, groups, head="none", allowed_extra=allowed)
    source = load_value_head(model, SafetensorsReader(folder)) if groups.is_last_stage else None
    return model, spec, source


def check_reward_head(folder: str) -> None:
    """An HF folder without a reward head fails here, on every rank, before anything is built."""
    names = set(SafetensorsReader(folder).names())
    if not any(w in names for w, _ in REWARD_HEADS):
        raise CheckpointMismatchError(
            f"{folder} has no reward head ({', '.join(w for w, _ in REWARD_HEADS)}): a reward model is an HF "
            "*ForSequenceClassification folder with num_labels=1 (scripts/train_rm.py writes one)")


def reward_model_from_hf(folder: str, groups, dtype: str = "float32", **config_overrides):
    """(model, spec, pad_token_id) of an HF reward model folder: the trunk and its `score` head.

    pad_token_id is the config's (None when unset); it decides the scored token (workers/reward_model.py).
    """
    check_reward_head(folder)
    model, spec, _ = critic_from_hf(folder, groups, dtype, **config_overrides)
    return model, spec, as_config_dict(folder).get("pad_token_id")


def reward_model_hf_stream(model, spec: GPTSpec, groups):
    """(HF name, full tensor) of a critic-shaped model as a *ForSequenceClassification: trunk, score.weight.

    Collective over the model replica, like `mcore_to_hf_stream`. HF's score layer has no bias, so the
    value head's bias must be zero (scripts/train_rm.py keeps it frozen at 0; Bradley-Terry ignores it).
    """
    yield from mcore_to_hf_stream(model, spec, groups, head="none")
    inner = unwrap_model(model)
    if groups.is_last_stage:
        head = inner.output_layer.value_head
        if torch.count_nonzero(head.bias.detach()) > 0:
            raise ValueError(f"value head bias {head.bias.item():.4g} != 0 cannot be written as HF's bias-free "
                             "score.weight; freeze it at zero while training")
        weight = head.weight.detach().clone()
    else:
        # the head's dtype (the model's), not a first parameter's: a middle stage of a local-spec bf16 model starts
        # with an fp32 norm
        weight = torch.empty(1, spec.hidden_size, dtype=inner.config.params_dtype, device=sample_weight(model).device)
    if groups.pp > 1:
        dist.broadcast(weight, group=groups.pp_group, group_src=groups.pp - 1)
    yield "score.weight", weight


def reward_model_hf_config(base: dict, pad_token_id: int | None) -> dict:
    """The config.json of a sequence-classification reward model (one label) built from `base`'s architecture."""
    cfg = dict(base)
    cfg.update(architectures=[SEQ_CLS_ARCHITECTURES[cfg["model_type"]]], id2label={"0": "LABEL_0"},
               label2id={"LABEL_0": 0}, pad_token_id=pad_token_id)
    return cfg
