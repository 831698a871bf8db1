"""A training checkpoint's actor as an HF folder (config.json + model.safetensors, and the tokenizer and
generation config files of an HF source folder), offline.

Runs under any world size: the model is rebuilt at the layout asked for (TP x PP, DP the rest of the
world, TP 1 x PP 1 by default), its shards are read from the checkpoint whatever layout wrote it,
and the HF export stream (TP gather, PP broadcast, un-fusing) is written by rank 0. The actor's files are
checked against the sizes and crc32s meta.json lists before anything is read. Collective.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from hybridrl.checkpoint.folders import CheckpointError, check_step_folder, read_meta
from hybridrl.checkpoint.resume import damage, naming_damage
from hybridrl.checkpoint.sharded import check_shapes, fill_model, model_sharded_state


def _saved_dtype(folder: str) -> str:
    from megatron.core import dist_checkpointing

    from hybridrl.models.gpt import DTYPES

    saved = dist_checkpointing.load_tensors_metadata(folder)
    name = "embedding.word_embeddings.weight"  # a LoRA actor's checkpoint holds its adapters only
    dtype = saved[name if name in saved else next(k for k in saved if not k.startswith("optimizer."))].dtype
    return next(name for name, d in DTYPES.items() if d == dtype)


def checkpoint_to_hf(step_folder: str, out: str, tp: int = 1, pp: int = 1, source: str = "") -> None:
    """Write the actor of `step_folder` (a global_step_* folder) to `out` as an HF checkpoint, with the tokenizer
    and generation config files of the HF folder `source` (a LoRA actor's: its base unless given)."""
    from megatron.core import dist_checkpointing

    from hybridrl.models.hf_checkpoint import copy_hf_side_files
    from hybridrl.models.lora_export import export_lora_model
    from hybridrl.parallel.distributed import init_model_parallel

    check_step_folder(step_folder, "--input")
    problem = damage(step_folder, digests=True, parts=("actor",))
    if problem:
        raise CheckpointError(f"--input {step_folder} is damaged: {problem}; pass another global_step_* folder")
    meta = read_meta(step_folder, ("hf_config",))
    hf_config, lora = meta["hf_config"], meta.get("lora")
    world, layers = dist.get_world_size(), hf_config.get("num_hidden_layers", 0)
    if tp < 1 or pp < 1 or world % (tp * pp) or layers % pp:
        raise CheckpointError(f"--tp {tp} x --pp {pp} does not fit {world} process(es) and {layers} layers: tp x pp "
                              f"must divide the world size and pp the layer count")
    actor = os.path.join(step_folder, "actor")
    groups = init_model_parallel(tp, pp)
    with naming_damage(step_folder, "actor", "pass another global_step_* folder"):
        model, spec = _actor_model(hf_config, lora, groups, _saved_dtype(actor))
        state = model_sharded_state(model)
        check_shapes(state, actor, "actor")
        loaded = dist_checkpointing.load({"model": state}, actor)["model"]  # weights only
    fill_model(model, loaded, actor, "actor")
    base = lora["base"] if lora else ""
    export_lora_model(model, spec, groups, out, hf_config, base)  # LoRA: merged, and the PEFT adapter in out/adapter
    if dist.get_rank() == 0:
        copy_hf_side_files(source or base, out)


def _actor_model(hf_config: dict, lora: dict | None, groups, dtype: str):
    """The actor to fill from the checkpoint: random init, or for LoRA the named base with fresh adapters."""
    from hybridrl.config.lora import LoraConfig
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.models.lora import apply_lora

    if not lora:
        return model_from_hf(hf_config, groups, dtype)
    base = lora["base"]
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise CheckpointError(f"the LoRA checkpoint holds adapters for the base model {base!r}, which has no "
                              "config.json here; make that HF folder available at that path")
    model, spec = model_from_hf(base, groups, dtype, layer_spec="local")
    settings = {k: v for k, v in lora.items() if k != "base"}
    apply_lora(model, LoraConfig(**settings), spec, groups.pp, groups.pp_rank, base=base)
    return model, spec
