"""LoRA adapters on megatron-core's parallel linears: W x + (alpha / r) * B A x, base weights frozen.

`apply_lora` swaps each targeted ColumnParallelLinear / RowParallelLinear for a subclass that adds the
adapters (`lora_adapters.<hf part>.lora_{A,B}`, PEFT's names and shapes per HF module). TP: for a
column-parallel base A is replicated and B split on its output; for a row-parallel base A is split on
its input and B replicated. The forward runs the base's own collective once (input copy / sequence
gather for a column base, output all-reduce / reduce-scatter for a row base) around base + adapter; the
replicated factor's gradient is a partial sum on each TP rank, all-reduced in the backward (r x width).
Fused layouts keep one adapter per HF module: linear_qkv holds q, k, v (their outputs interleaved per
query group as megatron's QKV rows), linear_fc1 holds gate and up ([gate; up] per TP rank).
A starts as PEFT's kaiming init (seeded by the HF module name, the same at every TP/PP), B at zero.
The reference policy is the base (`adapters_disabled`); the engine receives W + s B A (`merged_weights`).
This module knows nothing of RL, checkpoints or engines.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from hybridrl.config.lora import LORA_MODULES, LoraConfig
from hybridrl.models import hf_convert as hc

ADAPTERS = "lora_adapters"
# megatron module suffix in a layer -> HF module prefix in a layer
HF_PREFIX = {"self_attention.linear_qkv": "self_attn", "self_attention.linear_proj": "self_attn",
             "mlp.linear_fc1": "mlp", "mlp.linear_fc2": "mlp"}


def is_adapter_key(name: str) -> bool:
    return f".{ADAPTERS}." in name or name.startswith(f"{ADAPTERS}.")


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _tp_size(group) -> int:
    return group.size() if group is not None else 1


def _tp_copy(t: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, TP all-reduce of the gradient: a replicated factor whose gradient is partial per rank."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(t, group=group) if _tp_size(group) > 1 else t


class Adapter(torch.nn.Module):
    """One HF module's pair: lora_A [r, in(/tp)], lora_B [out(/tp), r]."""

    def __init__(self, a: torch.Tensor, out_features: int, dropout: float):
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(a.new_zeros(out_features, a.shape[0]))
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()


class LoraLinear:
    """What the column and row subclasses share: the parts, their assembly, the merged weight."""
    lora_parts: list      # [(hf part, local output size)] in megatron's order
    lora_groups: int      # query groups on this TP rank (linear_qkv), else 0
    lora_scaling: float
    lora_enabled: bool = True

    def _assemble(self, pieces: list, dim: int) -> torch.Tensor:
        """Per-part tensors (outputs along `dim`) in the base's fused layout."""
        if len(pieces) == 1:
            return pieces[0]
        if not self.lora_groups:  # [gate; up]
            return torch.cat(pieces, dim=dim)
        moved = [p.movedim(dim, -1) for p in pieces]
        lead = moved[0].shape[:-1]
        grouped = torch.cat([m.reshape(*lead, self.lora_groups, -1) for m in moved], dim=-1)
        return grouped.reshape(*lead, -1).movedim(-1, dim)

    def _factors(self, adapter: Adapter):
        """(A, B) as used in the forward: the replicated one through `_tp_copy`."""
        if self.lora_column:
            return _tp_copy(adapter.lora_A, self.tp_group), adapter.lora_B
        return adapter.lora_A, _tp_copy(adapter.lora_B, self.tp_group)

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) * B A x for every part, zeros for parts without an adapter."""
        pieces = []
        for part, size in self.lora_parts:
            if part not in self.lora_adapters:
                pieces.append(x.new_zeros(*x.shape[:-1], size))
                continue
            adapter = self.lora_adapters[part]
            a, b = self._factors(adapter)
            pieces.append(F.linear(F.linear(self._dropped(adapter, x), a), b) * self.lora_scaling)
        return self._assemble(pieces, -1)

    def _dropped(self, adapter: Adapter, x: torch.Tensor) -> torch.Tensor:
        """The adapter's dropout on x. A row-parallel input is this TP rank's slice of the features: its mask comes
        from megatron's model-parallel RNG stream (one per TP rank, the expert one in expert layers), as megatron
        drops what is split over TP. The default stream, equal on every TP rank, repeated one mask on every slice.
        A column-parallel input is whole on every rank: the default stream gives each rank the same mask."""
        if not adapter.training or isinstance(adapter.dropout, torch.nn.Identity) or self.lora_column \
                or _tp_size(self.tp_group) == 1:
            return adapter.dropout(x)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        stream = get_expert_parallel_rng_tracker_name() if self.explicit_expert_comm else None
        with get_cuda_rng_tracker().fork(*([stream] if stream else [])):
            return adapter.dropout(x)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + (alpha / r) * B A (a new tensor; the parameters are untouched)."""
        w = self.weight
        pieces = []
        for part, size in self.lora_parts:
            if part in self.lora_adapters:
                ad = self.lora_adapters[part]
                pieces.append((ad.lora_B @ ad.lora_A).to(w.dtype) * self.lora_scaling)
            else:
                pieces.append(w.new_zeros(size, w.shape[1]))
        return w + self._assemble(pieces, 0)


def _column_class():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    class LoraColumnParallelLinear(LoraLinear, ColumnParallelLinear):
        lora_column = True

        def forward(self, input_, weight=None, runtime_gather_output=None):
            if not self.lora_enabled or weight is not None:
                return super().forward(input_, weight, runtime_gather_output)
            if self.explicit_expert_comm or _tp_size(self.tp_group) == 1:
                x = input_
            elif self.sequence_parallel:  # the base's own sequence gather, done once for both paths
                x = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=self.tp_group)
            else:
                x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            bias = self.bias if not self.skip_bias_add else None
            out = torch.matmul(x, self.weight.t())
            out = (out + bias if bias is not None else out) + self.lora_delta(x)
            if runtime_gather_output if runtime_gather_output is not None else self.gather_output:
                raise NotImplementedError("LoRA on a column-parallel linear that gathers its output")
            return out, self.bias if self.skip_bias_add else None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return _sharded(self, prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0}, "lora_B")

    return LoraColumnParallelLinear


def _row_class():
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)

    class LoraRowParallelLinear(LoraLinear, RowParallelLinear):
        lora_column = False

        def forward(self, input_):
            if not self.lora_enabled or not self.input_is_parallel:
                return super().forward(input_)
            partial = torch.matmul(input_, self.weight.t()) + self.lora_delta(input_)
            if self.explicit_expert_comm or _tp_size(self.tp_group) == 1:
                out = partial
            elif self.sequence_parallel:  # base and adapter partial sums reduced in the base's one collective
                out = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
            else:
                out = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
            if self.skip_bias_add:
                return out, self.bias
            return (out + self.bias if self.bias is not None else out), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return _sharded(self, prefix, sharded_offsets, metadata, {"weight": 1}, "lora_A")

    return LoraRowParallelLinear


def _sharded(module, prefix, sharded_offsets, metadata, base_axes: dict, split: str) -> dict:
    """megatron's sharded state of the base plus the adapters, the TP-split factor on the base's TP axis."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = module.state_dict(prefix="", keep_vars=True)
    axes = dict(base_axes)
    axes.update({k: base_axes["weight"] for k in state if is_adapter_key(k) and k.endswith(split)})
    return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=module.tp_group,
                                               dp_cp_group=metadata["dp_cp_group"])


def _parts(suffix: str, spec, tp: int) -> tuple[list, int]:
    """[(hf part, local output size)] of a megatron module and its local query groups (linear_qkv only)."""
    module = suffix.rsplit(".", 1)[-1]
    names = LORA_MODULES[module]
    if module == "linear_qkv":
        groups = spec.num_key_value_heads // tp
        per_group = spec.num_attention_heads // spec.num_key_value_heads
        d = spec.kv_channels
        return list(zip(names, (groups * per_group * d, groups * d, groups * d))), groups
    if module == "linear_fc1":
        return [(n, spec.intermediate_size // tp) for n in names], 0
    return [(names[0], spec.hidden_size)], 0


def hf_module_name(global_module: str) -> tuple[str, str]:
    """('model.layers.i.<self_attn|mlp>', megatron suffix) of a global megatron module name."""
    layer, suffix = global_module.split(".", 3)[2], global_module.split(".", 3)[3]
    return f"model.layers.{layer}.{HF_PREFIX[suffix]}", suffix


def _init_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """PEFT's init of lora_A (kaiming uniform, a = sqrt 5) over the full input, seeded by the HF module name."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    a = torch.empty(rank, in_features)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


def targets(model, cfg: LoraConfig) -> list:
    """(local module name, module) of every adapted linear: the dense ones whose HF parts are targeted."""
    wanted = set(cfg.hf_targets())
    out = []
    for name, module in _unwrap(model).named_modules():
        suffix = ".".join(name.split(".")[3:]) if name.startswith("decoder.layers.") else ""
        if suffix in HF_PREFIX and wanted & set(LORA_MODULES[suffix.rsplit(".", 1)[-1]]):
            out.append((name, module))
    return out


def apply_lora(model, cfg: LoraConfig, spec, pp: int, pp_rank: int, seed: int = 0, base: str = "") -> int:
    """Freeze every parameter of `model` and add trainable adapters to the targeted linears (before DDP
    wraps it); `base` names the HF folder of the frozen weights (checkpoints record it, not the weights).
    Returns how many HF modules got an adapter on this rank."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      set_tensor_model_parallel_attributes)

    gpt = _unwrap(model)
    for p in gpt.parameters():
        p.requires_grad_(False)
    column, row = _column_class(), _row_class()
    wanted = cfg.hf_targets()
    offset = hc.layer_range(spec.num_layers, pp, pp_rank).start
    count = 0
    for name, module in targets(gpt, cfg):
        if type(module) not in (ColumnParallelLinear, RowParallelLinear):
            raise TypeError(f"LoRA adapts megatron's local-spec linears; {name} is {type(module).__name__}")
        is_column = isinstance(module, ColumnParallelLinear)
        tp, tp_rank = _tp_size(module.tp_group), (module.tp_group.rank() if module.tp_group is not None else 0)
        hf_prefix, suffix = hf_module_name(hc.local_to_global(name, offset))
        parts, groups = _parts(suffix, spec, tp)
        full_in = module.weight.shape[1] * (1 if is_column else tp)
        adapters = torch.nn.ModuleDict()
        for part, local_out in parts:
            if part not in wanted:
                continue
            a = _init_a(f"{hf_prefix}.{part}", cfg.rank, full_in, seed)
            if not is_column:
                a = a.chunk(tp, dim=1)[tp_rank]
            a = a.to(device=module.weight.device, dtype=module.weight.dtype).contiguous()
            adapter = Adapter(a, local_out, cfg.dropout)
            split = adapter.lora_B if is_column else adapter.lora_A
            set_tensor_model_parallel_attributes(split, True, 0 if is_column else 1, 1)
            for p in adapter.parameters():
                p.allreduce = getattr(module.weight, "allreduce", True)
            adapters[part] = adapter
            count += 1
        module.__class__ = column if is_column else row
        module.lora_adapters, module.lora_parts, module.lora_groups = adapters, parts, groups
        module.lora_scaling = cfg.scaling
    gpt.lora_config, gpt.lora_base = cfg, base
    return count


def adapted_modules(model) -> list:
    return [m for m in _unwrap(model).modules() if isinstance(m, LoraLinear)]


def has_adapters(model) -> bool:
    return getattr(_unwrap(model), "lora_config", None) is not None


def adapter_state(model, state: dict) -> dict:
    """A checkpoint's part of a state dict: with adapters only they (the base is named, not saved), else all."""
    return {k: v for k, v in state.items() if is_adapter_key(k)} if has_adapters(model) else state


def must_fill(model, key: str) -> bool:
    """Whether loading a checkpoint must fill state-dict entry `key` (not the frozen base of a LoRA model)."""
    return not key.endswith("_extra_state") and (is_adapter_key(key) or not has_adapters(model))


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model inside the block (the LoRA run's reference policy)."""
    modules = adapted_modules(model)
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_enabled = True


# ---- the merged view that the engine handoff and the HF export read ---------------------------------

class MergedState(Mapping):
    """A weight state whose adapted weights read as W + s B A, computed one tensor at a time on access."""

    def __init__(self, state: dict, merged: dict):
        self._state, self._merged = state, merged

    def __getitem__(self, key):
        module = self._merged.get(key)
        return self._state[key] if module is None else module.merged_weight()

    def __iter__(self):
        return iter(self._state)

    def __len__(self):
        return len(self._state)

    def renamed(self, fn) -> "MergedState":
        return MergedState({fn(k): v for k, v in self._state.items()}, {fn(k): m for k, m in self._merged.items()})


def state_view(model, state: dict):
    """`state` (a module's base weights by name), merged inside a `merged_weights` block."""
    gpt = _unwrap(model)
    if not getattr(gpt, "lora_merged_view", False):
        return state
    merged = {f"{n}.weight": m for n, m in gpt.named_modules() if isinstance(m, LoraLinear)}
    return MergedState(state, merged)


def renamed(state, fn):
    """`state` under the names fn(name), staying lazy when it is a MergedState."""
    return state.renamed(fn) if isinstance(state, MergedState) else {fn(k): v for k, v in state.items()}


@contextlib.contextmanager
def merged_weights(model):
    """Inside the block the model's weight state (`hf_checkpoint.weight_state`) reads merged weights."""
    gpt = _unwrap(model)
    gpt.lora_merged_view = has_adapters(gpt)
    try:
        yield
    finally:
        gpt.lora_merged_view = False
