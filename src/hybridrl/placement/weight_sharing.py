"""Where the rollout engine reads the trainer's own tensors instead of a copy: the layouts that allow it and the
handoffs that adopt them (identity checked, no byte read). `reshard.update_engine_weights` picks among them.

- `shares_weights`: colocated, rollout TP = TP, PP 1, EP 1, the parameters' dtype, on their device: the engine
  reads every training tensor (`share_all`).
- `takes_shards`: the same layout without sharing: shards copied straight into the engine (`reshard._send_shards`).
- `shares_stage`: the same at PP > 1: the engine reads its own stage's tensors (`share_stage`) and takes the other
  stages' (`reshard._send_layout`).
"""
from __future__ import annotations

import torch

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec
from hybridrl.models.hf_checkpoint import sample_weight, weight_state
from hybridrl.placement.readback import HandoffError, check_identity


def source_tensor(local: dict, global_name: str) -> torch.Tensor:
    """The tensor every handoff path reads for `global_name`: this rank's training shard (detached)."""
    return local[global_name].detach()


def shares_stage(engine, model, groups) -> bool:
    """Pipeline stages (PP > 1, EP 1) with the engine at this rank's TP layout and dtype, on its device: the
    engine reads this stage's own training tensors (`share_shards`) and takes the other stages' layers."""
    return groups.pp > 1 and _reads_in_place(engine, model) and _same_shards(engine, model, groups)


def share_stage(engine, own, local: dict, verifying: bool) -> None:
    """The engine reads this stage's own tensors (`own`, global names) from the training tensors (identity
    checked, as `share_all`)."""
    _adopt(engine, [(g, source_tensor(local, g)) for g in own], verifying)


def share_all(engine, model, spec: GPTSpec, groups, bucket_bytes: int, verify: str) -> tuple:
    """The engine adopts this rank's training tensors (first handoff) or shows the ones it holds; each
    must be the training tensor itself: the same storage (not a copy at an equal address: the storage
    object, which survives offload / onload), offset, shape, stride and dtype, and the same version
    counter (an alias of the parameter, so every in-place update is seen). No byte is read."""
    local = weight_state(model)
    shards = [(g, source_tensor(local, g)) for _, g in hc.stage_names(spec, 1, 0)]
    _adopt(engine, shards, verify != "off")
    return len(shards), 0, 0, 0


def _adopt(engine, shards: list, verifying: bool) -> None:
    held = engine.share_shards(shards)
    for name, sent in shards if verifying else ():
        if name not in held:
            raise HandoffError(f"engine did not report tensor {name!r}: it was shared but not adopted")
        check_identity(name, sent, *held[name])


def shares_weights(engine, model, groups) -> bool:
    """The engine can read this rank's training tensors themselves: it offers `share_shards`, takes
    them as they are (`takes_shards`: same TP layout and dtype, PP 1, EP 1) and lives on their device."""
    return _reads_in_place(engine, model) and takes_shards(engine, model, groups)


def takes_shards(engine, model, groups) -> bool:
    """The engine holds this rank's training shards as they are: same TP layout and dtype, PP 1, EP 1."""
    return groups.pp == 1 and _same_shards(engine, model, groups)


def _reads_in_place(engine, model) -> bool:
    """The engine can alias tensors (`share_shards`) and lives on the training tensors' device."""
    return hasattr(engine, "share_shards") and getattr(engine, "device", None) == sample_weight(model).device


def _same_shards(engine, model, groups) -> bool:
    """EP 1, and the engine's TP layout and dtype are this rank's training shards'."""
    layout = getattr(engine, "shard_layout", None)
    return (layout is not None and groups.ep == 1
            and layout() == (groups.tp, groups.tp_rank, sample_weight(model).dtype))
