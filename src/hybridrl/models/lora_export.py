"""A LoRA model's adapters as a PEFT adapter folder: full (TP-merged, every pipeline stage) lora_A / lora_B
under PEFT's HF module names, `adapter_config.json` and `adapter_model.safetensors`.

`full_adapters` is collective over the model replica (TP x PP); the folder is written by one rank.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from hybridrl.config.lora import LORA_MODULES, LoraConfig
from hybridrl.models import hf_convert as hc
from hybridrl.models.hf_checkpoint import unwrap_model
from hybridrl.models.lora import LoraLinear, hf_module_name

PEFT_PREFIX = "base_model.model."
ADAPTER_FOLDER = "adapter"


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    if group is None or group.size() == 1:
        return t.detach()
    shards = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(shards, t.detach().contiguous(), group=group)
    return torch.cat(shards, dim=dim)


def local_adapters(model, spec, groups) -> dict:
    """{PEFT key: full tensor} of this pipeline stage's adapters (TP shards gathered)."""
    offset = hc.layer_range(spec.num_layers, groups.pp, groups.pp_rank).start
    out = {}
    for name, module in unwrap_model(model).named_modules():
        if not isinstance(module, LoraLinear):
            continue
        hf_prefix, _ = hf_module_name(hc.local_to_global(name, offset))
        for part, adapter in module.lora_adapters.items():
            a_dim, b_dim = (None, 0) if module.lora_column else (1, None)
            a = adapter.lora_A.detach() if a_dim is None else _gather(adapter.lora_A, a_dim, module.tp_group)
            b = adapter.lora_B.detach() if b_dim is None else _gather(adapter.lora_B, b_dim, module.tp_group)
            key = f"{PEFT_PREFIX}{hf_prefix}.{part}"
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a.cpu(), b.cpu()
    return out


def full_adapters(model, spec, groups) -> dict:
    """{PEFT key: full tensor} of the whole model on every rank (stages exchange theirs over PP)."""
    mine = local_adapters(model, spec, groups)
    if groups.pp == 1:
        return mine
    stages = [None] * groups.pp
    dist.all_gather_object(stages, mine, group=groups.pp_group)
    return {k: v for stage in stages for k, v in stage.items()}


def adapter_config(cfg: LoraConfig, base_model: str, moe: bool = False) -> dict:
    """PEFT's adapter_config.json of a LoRA adapter with these settings; of an MoE model only its attention
    modules (all-linear adapts only those there: PEFT would otherwise wrap the experts the run never trained)."""
    mlp = LORA_MODULES["linear_fc1"] + LORA_MODULES["linear_fc2"]
    targets = [t for t in cfg.hf_targets() if not (moe and t in mlp)]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "bias": "none",
            "target_modules": targets, "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def save_peft_adapter(folder: str, adapters: dict, cfg: LoraConfig, base_model: str, moe: bool = False) -> None:
    """Write `folder`/adapter_config.json and adapter_model.safetensors (call on one rank)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(adapter_config(cfg, base_model, moe), f, indent=2, sort_keys=True)
    save_file({k: v.contiguous().clone() for k, v in adapters.items()}, os.path.join(folder, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def lora_meta(model) -> dict:
    """{"lora": settings and base folder} for a checkpoint's meta.json of a LoRA actor, else {}."""
    gpt = unwrap_model(model)
    cfg = getattr(gpt, "lora_config", None)
    if cfg is None:
        return {}
    return {"lora": {"base": getattr(gpt, "lora_base", ""), "rank": cfg.rank, "alpha": cfg.alpha,
                     "dropout": cfg.dropout, "target_modules": list(cfg.target_modules)}}


def export_lora_model(model, spec, groups, folder: str, hf_config: dict, base: str) -> None:
    """`folder`: the merged model (config.json + model.safetensors, with `base`'s tokenizer and generation config
    files) and, in `folder`/adapter, the PEFT adapter for `base`. Without adapters only the model. Collective over
    the replica; rank 0 writes."""
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, save_hf
    from hybridrl.models.lora import has_adapters, merged_weights

    with merged_weights(model):
        save_hf(folder, mcore_to_hf_stream(model, spec, groups), hf_config, source=base)
    if not has_adapters(model):
        return
    adapters = full_adapters(model, spec, groups)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_peft_adapter(os.path.join(folder, ADAPTER_FOLDER), adapters, unwrap_model(model).lora_config, base,
                          spec.num_experts > 0)


def check_resume(path: str, saved: dict | None, model) -> None:
    """A checkpoint's adapters fit only the LoRA settings and base they were trained with: raise ValueError
    naming both when `saved` (meta.json's "lora", None for full fine-tuning) differs from this run's."""
    now = lora_meta(model).get("lora")
    same = (saved is None) == (now is None) and (saved is None or (
        {k: v for k, v in saved.items() if k != "base"} == {k: v for k, v in now.items() if k != "base"}
        and _same_base(saved["base"], now["base"])))
    if not same:
        raise ValueError(f"{path} was saved with actor LoRA {saved or 'off'} but this run has {now or 'off'}; "
                         "resume with the actor.lora.* settings and model.path it was saved with, or start a new run "
                         "(trainer.resume_mode=disable)")


def _same_base(saved: str, now: str) -> bool:
    """The same folder, or (moved or copied) one with byte-identical config.json and safetensors files."""
    import filecmp

    if os.path.realpath(saved) == os.path.realpath(now):
        return True
    names = lambda d: sorted(f for f in os.listdir(d) if f == "config.json" or ".safetensors" in f)  # noqa: E731
    if not os.path.isdir(saved) or names(saved) != names(now):
        return False
    return all(filecmp.cmp(os.path.join(saved, f), os.path.join(now, f), shallow=False) for f in names(now))
