"""HF safetensors checkpoints <-> a live megatron GPTModel sharded over TP/PP.

Loading reads lazily (`safe_open` + `get_slice`): each rank reads only its own TP/PP slice, so no
rank materialises the full model. Exporting streams one tensor at a time: broadcast from its PP
owner, all-gathered over TP, un-fused to HF names. The pure name/layout rules live in
`hf_convert.py`; this module does the I/O and the collectives and nothing model-specific beyond that.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import torch
import torch.distributed as dist

from hybridrl.models import hf_convert as hc, lora
from hybridrl.models.gpt import GPTSpec, build_gpt, for_this_machine
from hybridrl.models.hf_config import as_config_dict, check_parallel_layout, spec_from_hf_config

__all__ = ["SafetensorsReader", "CheckpointMismatchError", "check_checkpoint", "load_hf_into_mcore",
           "mcore_to_hf_stream", "save_hf", "model_from_hf", "random_hf_model_folder", "unwrap_model"]

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# What an HF model folder holds besides config.json and the weights, copied into an export from its source
# (what verl's HF export writes with the tokenizer's and generation config's save_pretrained).
HF_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
                 "chat_template.jinja", "chat_template.json")
# Buffers some HF checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the architecture its config describes."""


class SafetensorsReader:
    """`hf_convert.TensorReader` over a folder with model.safetensors or a sharded index; lazy slices."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = os.path.join(folder, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(folder, SINGLE_FILE)):
            files = None
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")
        paths = sorted(set(files.values())) if files else [SINGLE_FILE]
        self._handles = {p: safe_open(os.path.join(folder, p), framework="pt") for p in paths}
        self._file = files or {n: SINGLE_FILE for n in self._handles[SINGLE_FILE].keys()}
        self.folder = folder

    def names(self) -> list[str]:
        return list(self._file)

    def shape(self, name):
        return tuple(self._handles[self._file[name]].get_slice(name).get_shape())

    def read(self, name, dim=None, start=0, stop=None):
        handle = self._handles[self._file[name]]
        if dim is None:
            return handle.get_tensor(name)
        sl = handle.get_slice(name)
        stop = sl.get_shape()[dim] if stop is None else stop
        return sl[start:stop] if dim == 0 else sl[:, start:stop]


def check_checkpoint(reader, spec: GPTSpec, head: str = "lm", allowed_extra=()) -> None:
    """Raise `CheckpointMismatchError` naming the tensor and the expected shape on any mismatch."""
    expected = hc.hf_shapes(spec, head)
    names = set(reader.names())
    where = getattr(reader, "folder", "the checkpoint")
    missing = [n for n in expected if n not in names]
    if missing:
        n = missing[0]
        raise CheckpointMismatchError(f"missing tensor {n!r} (expected shape {list(expected[n])}) in {where}"
                                      + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    tolerated = set(allowed_extra) | ({hc.HF_LM_HEAD} if spec.tie_word_embeddings else set())
    for n in sorted(names - set(expected)):
        if n in tolerated or n.endswith(_IGNORED_SUFFIXES):
            continue
        raise CheckpointMismatchError(f"unexpected tensor {n!r} with shape {list(reader.shape(n))} in {where}: "
                                      f"not part of the configured model ({spec.num_layers} layers, "
                                      f"tie_word_embeddings={spec.tie_word_embeddings})")
    for n, shape in expected.items():
        if reader.shape(n) != shape:
            raise CheckpointMismatchError(f"tensor {n!r} has shape {list(reader.shape(n))}, "
                                          f"expected shape {list(shape)} in {where}")


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module style wrappers (`.module` chains)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def sample_weight(model) -> torch.Tensor:
    """One of the model's weight matrices (its first parameter of two or more dims: the embedding or a linear),
    for what they share (dtype, device), without building a state dict, which walks every module (a handoff asks
    four times). Not any first parameter: the local spec's norms keep fp32 weights in a bf16 model, and a pipeline
    stage without the embedding starts with one (its stages would disagree on the model's dtype)."""
    params = unwrap_model(model).parameters()
    first = next(params)
    return first if first.dim() >= 2 else next((p for p in params if p.dim() >= 2), first)


def weight_state(model) -> dict[str, torch.Tensor]:
    """The model's state dict without megatron's weightless `_extra_state` entries and LoRA adapters; inside
    `lora.merged_weights(model)` the adapted weights read as merged, one tensor at a time."""
    state = {k: v for k, v in unwrap_model(model).state_dict().items()
             if not k.endswith("_extra_state") and not lora.is_adapter_key(k)}
    return lora.state_view(model, state)


def copy_into(model, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy `state` into the model's tensors; the key sets must agree exactly."""
    target = weight_state(model)
    if set(target) != set(state):
        extra, lacking = sorted(set(state) - set(target)), sorted(set(target) - set(state))
        raise CheckpointMismatchError(f"{what}: megatron names disagree; not in model: {extra[:3]}, "
                                      f"not in checkpoint: {lacking[:3]}")
    with torch.no_grad():
        for name, dst in target.items():
            if tuple(dst.shape) != tuple(state[name].shape):
                raise CheckpointMismatchError(f"{what}: {name!r} has shape {list(state[name].shape)}, "
                                              f"expected shape {list(dst.shape)}")
            dst.copy_(state[name])


def load_hf_into_mcore(model, hf_folder: str, spec: GPTSpec, groups, head: str = "lm", allowed_extra=()) -> None:
    """Fill this rank's TP/PP slice of `model` from an HF folder (single-file or sharded safetensors)."""
    reader = SafetensorsReader(hf_folder)
    check_checkpoint(reader, spec, head, allowed_extra)
    state = hc.stage_state(reader, spec, groups.tp, groups.pp, groups.tp_rank, groups.pp_rank, head,
                           groups.ep, groups.ep_rank)
    if head != "lm":  # the critic keeps its own head; load only the trunk here
        state.update({k: v for k, v in weight_state(model).items() if k.startswith("output_layer.")})
    copy_into(model, state, hf_folder)


def global_weight_state(model, spec: GPTSpec, groups) -> dict[str, torch.Tensor]:
    """This rank's weights under global names (global layer and expert indices)."""
    offset = hc.layer_range(spec.num_layers, groups.pp, groups.pp_rank).start
    experts = hc.expert_range(spec, groups.ep, groups.ep_rank).start if spec.is_moe else 0
    return lora.renamed(weight_state(model), lambda k: hc.local_to_global(k, offset, experts))


def _from_ep_owner(global_name: str, local: dict, spec: GPTSpec, groups, sample) -> torch.Tensor:
    """This rank's TP shard of `global_name`; an expert held by another EP rank is broadcast from it."""
    owner = hc.owner_ep_rank(global_name, spec, groups.ep)
    if owner is None or groups.ep == 1:
        return local[global_name].detach()
    if owner == groups.ep_rank:
        shard = local[global_name].detach().contiguous()
    else:
        full = hc.mcore_full_shape(global_name, spec, groups.tp)
        dim = hc.tp_split_dim(global_name)
        shape = tuple(n // groups.tp if d == dim else n for d, n in enumerate(full))
        shard = torch.empty(shape, dtype=sample.dtype, device=sample.device)
    dist.broadcast(shard, group=groups.ep_group, group_src=owner)
    return shard


def _gather_tp(global_name: str, shard: torch.Tensor, groups) -> torch.Tensor:
    if groups.tp == 1 or hc.tp_split_dim(global_name) is None:
        return shard
    shards = [torch.empty_like(shard) for _ in range(groups.tp)]
    dist.all_gather(shards, shard.contiguous(), group=groups.tp_group)
    return hc.merge_tp(global_name, shards)


def mcore_to_hf_stream(model, spec: GPTSpec, groups, head: str = "lm") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for the whole model, on every rank, one megatron tensor at a time.
    head "none" streams the trunk only (a critic or reward model keeps its own head).

    Collective: every rank of the model replica (TP x PP) must consume the stream in lockstep.
    Tied embeddings yield no lm_head.weight (the last stage's copy is a duplicate of the embedding).
    """
    local = global_weight_state(model, spec, groups)
    sample = sample_weight(model)
    for global_name in hc.hf_to_mcore_name_map(spec, head):
        owner = hc.owner_stage(global_name, spec, groups.pp)
        if groups.pp_rank == owner:
            full = _gather_tp(global_name, _from_ep_owner(global_name, local, spec, groups, sample), groups)
        else:  # on the model's device: the broadcast below runs on nccl with CUDA
            full = torch.empty(hc.mcore_full_shape(global_name, spec, groups.tp),
                               dtype=hc.held_dtype(global_name, spec, sample.dtype), device=sample.device)
        if groups.pp > 1:
            full = full.contiguous()
            dist.broadcast(full, group=groups.pp_group, group_src=owner)
        yield from hc.mcore_to_hf(global_name, full, spec)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def copy_hf_side_files(source: str, folder: str) -> list[str]:
    """Copy the `HF_SIDE_FILES` that `source` has (tokenizer, chat template, generation config) into `folder`;
    returns their names."""
    import shutil

    if not source or not os.path.isdir(source) or os.path.realpath(source) == os.path.realpath(folder):
        return []
    copied = [name for name in HF_SIDE_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))
    return copied


def save_hf(folder: str, stream, hf_config_dict: dict, writer: bool | None = None, source: str | None = None) -> None:
    """Consume `stream` (on all ranks) and write config.json + model.safetensors (on rank 0), with the tokenizer
    and generation config files of the HF folder `source` when given."""
    from safetensors.torch import save_file

    writer = _is_writer() if writer is None else writer
    tensors = {}
    for name, t in stream:
        if writer:  # clone: un-fused views share storage, which safetensors refuses
            tensors[name] = t.detach().to("cpu").contiguous().clone()
    if not writer:
        return
    os.makedirs(folder, exist_ok=True)
    cfg = dict(hf_config_dict)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    cfg.update(dtype=dtype)
    cfg.pop("torch_dtype", None)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(folder, SINGLE_FILE), metadata={"format": "pt"})
    copy_hf_side_files(source, folder)


def model_from_hf(hf_folder_or_config, groups, dtype: str = "float32", layer_spec: str | None = None,
                  **config_overrides):
    """(model, spec): this rank's GPTModel chunk, loaded from an HF folder (random init for a config).
    `config_overrides` go to megatron's TransformerConfig (e.g. activation recomputation); `layer_spec`
    forces "local" or "te" (LoRA adapts the local spec's linears), else the machine's default."""
    cfg = as_config_dict(hf_folder_or_config)
    spec = for_this_machine(spec_from_hf_config(cfg))  # the TE layer spec on CUDA with TE installed
    spec = dataclasses.replace(spec, layer_spec=layer_spec) if layer_spec else spec
    check_parallel_layout(spec, groups.tp, groups.pp, groups.ep)
    model = build_gpt(spec, groups.tp, groups.pp, groups.pp_rank, dtype, groups.ep, **config_overrides)
    is_folder = isinstance(hf_folder_or_config, (str, os.PathLike)) and os.path.isdir(hf_folder_or_config)
    if is_folder:
        load_hf_into_mcore(model, os.fspath(hf_folder_or_config), spec, groups)
    return model, spec


_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=251, max_position_embeddings=64, initializer_range=0.1)
_TINY_MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)}


def random_hf_model_folder(folder: str, model_type: str = "qwen2", seed: int = 0, head: str = "lm",
                           max_shard_size: str | None = None, **sizes) -> str:
    """Save a tiny random transformers model of `model_type` (qwen2, qwen3, llama, qwen3_moe, mixtral; no
    downloads) and return the folder. MoE defaults: 4 experts, top 2, expert size 32.

    head: "lm" (…ForCausalLM), "score" (…ForSequenceClassification, num_labels=1, a reward model) or
    "v_head" (causal LM + TRL-style `v_head.summary.{weight,bias}`). Defaults: hidden 64, 2 layers,
    4 heads / 2 KV heads, vocab 251, initializer_range 0.1 (logits of order 1), pad_token_id 0 with
    head "score"; `sizes` override any config field. Norm weights and biases are perturbed so
    conversions that mishandle them show.
    `max_shard_size` (e.g. "40KB") writes a sharded checkpoint with model.safetensors.index.json.
    """
    import transformers

    config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
                  "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
                  "mixtral": transformers.MixtralConfig}[model_type]
    config = config_cls(**{**_TINY, **_TINY_MOE.get(model_type, {}), **sizes})
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSequenceClassification if head == "score" else transformers.AutoModelForCausalLM
    if head == "score":
        config.num_labels, config.pad_token_id = 1, sizes.get("pad_token_id", 0)
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if head == "v_head":
        _add_v_head(folder, config.hidden_size, seed)
    return folder


def _add_v_head(folder: str, hidden: int, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, SINGLE_FILE)
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed + 1)
    tensors["v_head.summary.weight"] = 0.1 * torch.randn(1, hidden, generator=g)
    tensors["v_head.summary.bias"] = 0.1 * torch.randn(1, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})
