"""A training checkpoint's actor as an HF folder (config.json + model.safetensors), offline.

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

    dtype = dist_checkpointing.load_tensors_metadata(folder)["embedding.word_embeddings.weight"].dtype
    return next(name for name, d in DTYPES.items() if d == dtype)


def checkpoint_to_hf(step_folder: str, out: str, tp: int = 1, pp: int = 1) -> None:
    """Write the actor of `step_folder` (a global_step_* folder) to `out` as an HF checkpoint."""
    from megatron.core import dist_checkpointing

    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, model_from_hf, save_hf
    from hybridrl.parallel.distributed import init_model_parallel

    check_step_folder(step_folder, "--input")
    problem = damage(step_folder, digests=True, parts=("actor",))
    if problem:
        raise CheckpointError(f"--input {step_folder} is damaged: {problem}; pass another global_step_* folder")
    hf_config = read_meta(step_folder, ("hf_config",))["hf_config"]
    world, layers = dist.get_world_size(), hf_config.get("num_hidden_layers", 0)
    if tp < 1 or pp < 1 or world % (tp * pp) or layers % pp:
        raise CheckpointError(f"--tp {tp} x --pp {pp} does not fit {world} process(es) and {layers} layers: tp x pp "
                              f"must divide the world size and pp the layer count")
    actor = os.path.join(step_folder, "actor")
    groups = init_model_parallel(tp, pp)
    with naming_damage(step_folder, "actor", "pass another global_step_* folder"):
        model, spec = model_from_hf(hf_config, groups, _saved_dtype(actor))
        state = model_sharded_state(model)
        check_shapes(state, actor, "actor")
        loaded = dist_checkpointing.load({"model": state}, actor)["model"]  # weights only
    fill_model(model, loaded, actor, "actor")
    save_hf(out, mcore_to_hf_stream(model, spec, groups), hf_config)
