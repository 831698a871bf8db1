"""The megatron checkpoint folder format: one `mp_rank_{tp:02d}_{pp:03d}/model.pt` per rank + `spec.json`.

model.pt is a plain {local megatron name: tensor} state dict without the weightless `_extra_state`
entries; spec.json holds the GPTSpec, the layout (tp, pp), the source HF config and folder (for export).
Offline conversion in both directions uses only the pure mapping of `hf_convert` (no model is
built, no process group needed); live models save/load their own rank's file. The format has no
expert-parallel dimension: live models at EP > 1 are refused.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec
from hybridrl.models.hf_checkpoint import (SafetensorsReader, check_checkpoint, copy_into, save_hf,
                                           weight_state)
from hybridrl.models.hf_config import (as_config_dict, check_parallel_layout, spec_from_dict,
                                       spec_from_hf_config, spec_to_dict)

SPEC_FILE, MODEL_FILE = "spec.json", "model.pt"


def rank_dir(folder: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(folder, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")


def write_spec(folder: str, spec: GPTSpec, tp: int, pp: int, hf_config: dict, hf_folder: str = "") -> None:
    """spec.json; `hf_folder`: the HF folder converted from, whose tokenizer files an export takes along."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, SPEC_FILE), "w") as f:
        json.dump({"spec": spec_to_dict(spec), "tp": tp, "pp": pp, "hf_config": hf_config, "hf_folder": hf_folder},
                  f, indent=2)


def read_spec(folder: str) -> tuple[GPTSpec, int, int, dict]:
    """(spec, tp, pp, hf_config) of a megatron checkpoint folder."""
    path = os.path.join(folder, SPEC_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder} is not a megatron checkpoint folder: no {SPEC_FILE}")
    with open(path) as f:
        d = json.load(f)
    return spec_from_dict(d["spec"]), d["tp"], d["pp"], d["hf_config"]


def save_rank_state(folder: str, state: dict, tp_rank: int, pp_rank: int) -> None:
    os.makedirs(rank_dir(folder, tp_rank, pp_rank), exist_ok=True)
    torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()},
               os.path.join(rank_dir(folder, tp_rank, pp_rank), MODEL_FILE))


def load_rank_state(folder: str, tp_rank: int, pp_rank: int) -> dict:
    path = os.path.join(rank_dir(folder, tp_rank, pp_rank), MODEL_FILE)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _check_no_expert_parallelism(groups, what: str) -> None:
    """The folder has one file per (tp, pp) rank: under EP each rank holds only its own experts, numbered
    locally, so a save would keep EP rank 0's experts and a load would give every EP rank those."""
    if groups.ep > 1:
        raise ValueError(f"cannot {what} a megatron checkpoint folder at expert_model_parallel_size={groups.ep}: "
                         "it has one file per (tp, pp) rank and no expert-parallel dimension; use ep=1, or go "
                         "through HF (save_hf(mcore_to_hf_stream(...)) gathers every EP rank's experts, "
                         "model_from_hf loads them back at any EP)")


def save_mcore_checkpoint(model, folder: str, spec: GPTSpec, groups, hf_config: dict) -> None:
    """Each rank of a live model writes its own file (DP rank 0 only); rank 0 also writes spec.json. EP 1 only."""
    _check_no_expert_parallelism(groups, "save")
    if groups.dp_rank != 0:
        return
    save_rank_state(folder, weight_state(model), groups.tp_rank, groups.pp_rank)
    if groups.tp_rank == 0 and groups.pp_rank == 0:
        write_spec(folder, spec, groups.tp, groups.pp, hf_config)


def load_mcore_checkpoint(model, folder: str, groups) -> GPTSpec:
    """Load this rank's file into a live model built with the same spec and layout (EP 1 only)."""
    _check_no_expert_parallelism(groups, "load")
    spec, tp, pp, _ = read_spec(folder)
    if (tp, pp) != (groups.tp, groups.pp):
        raise ValueError(f"{folder} holds tp={tp}, pp={pp} shards but the model runs tp={groups.tp}, "
                         f"pp={groups.pp}: reconvert from HF or export + re-import with the new layout")
    copy_into(model, load_rank_state(folder, groups.tp_rank, groups.pp_rank), folder)
    return spec


def hf_folder_to_mcore(hf_folder: str, out: str, tp: int, pp: int, rank: int = 0, world_size: int = 1) -> GPTSpec:
    """Offline HF -> megatron folder; process `rank` of `world_size` writes every world_size-th rank file."""
    hf_config = as_config_dict(hf_folder)
    spec = spec_from_hf_config(hf_config)
    check_parallel_layout(spec, tp, pp)
    reader = SafetensorsReader(hf_folder)
    check_checkpoint(reader, spec)
    layout = [(t, p) for p in range(pp) for t in range(tp)]  # megatron's rank order: tp fastest
    for t, p in layout[rank::world_size]:
        save_rank_state(out, hc.stage_state(reader, spec, tp, pp, t, p), t, p)
    if rank == 0:
        write_spec(out, spec, tp, pp, hf_config, os.path.abspath(hf_folder))
    return spec


def mcore_folder_stream(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) for a whole megatron folder, merged from its per-rank files (mmap)."""
    spec, tp, pp, _ = read_spec(folder)
    states = {(t, p): load_rank_state(folder, t, p) for p in range(pp) for t in range(tp)}
    for global_name in hc.hf_to_mcore_name_map(spec):
        owner = hc.owner_stage(global_name, spec, pp)
        local = hc.global_to_local(global_name, hc.layer_range(spec.num_layers, pp, owner).start)
        shards = []
        for t in range(tp):
            if local not in states[(t, owner)]:
                raise KeyError(f"{rank_dir(folder, t, owner)}/{MODEL_FILE} lacks {local!r} "
                               f"(expected shape {list(hc.mcore_full_shape(global_name, spec, tp))} merged)")
            shards.append(states[(t, owner)][local])
        yield from hc.mcore_to_hf(global_name, hc.merge_tp(global_name, shards), spec)


def mcore_folder_to_hf(folder: str, out: str) -> None:
    """Offline megatron folder -> HF folder (config.json + model.safetensors, and the tokenizer and generation
    config files of the HF folder it was converted from, where that is still there)."""
    _, _, _, hf_config = read_spec(folder)
    with open(os.path.join(folder, SPEC_FILE)) as f:
        source = json.load(f).get("hf_folder", "")  # absent in folders written before it was recorded
    save_hf(out, mcore_folder_stream(folder), hf_config, writer=True, source=source)
