"""Training states of a LoRA actor (actor.lora) for the planner: the frozen base keeps its weights only;
gradients and Adam states exist for the adapters alone. Pure arithmetic on `memory.Arch`.

Adapter parameters of one HF module with input n and output m, rank r: r·(n + m); over TP the
column-parallel modules (q, k, v, gate, up) split B (r·m / t), the row-parallel ones (o, down) split A
(r·n / t); the replicated factor is whole on every rank. An MoE model's experts get no adapters.
"""
from __future__ import annotations

from hybridrl.config.lora import LoraConfig
from hybridrl.planner import memory as mem


def layer_adapter_params(arch: mem.Arch, cfg: LoraConfig, tp: int) -> int:
    """Adapter parameters of one transformer layer on one TP rank."""
    h, q, kv, f = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim, \
        arch.intermediate_size
    column = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv)}
    row = {"o_proj": (q, h)}
    if not arch.is_moe:
        column.update(gate_proj=(h, f), up_proj=(h, f))
        row["down_proj"] = (f, h)
    targets = cfg.hf_targets()
    return cfg.rank * (sum(n + m // tp for name, (n, m) in column.items() if name in targets)
                       + sum(n // tp + m for name, (n, m) in row.items() if name in targets))


def lora_state_bytes(arch: mem.Arch, cfg: LoraConfig, tp: int, pp: int, dp: int, dtype: str,
                     distributed_optimizer: bool, base_weights: float) -> dict:
    """weights / grads / optimizer bytes of one rank: the base's weights plus the adapters', whose gradients
    and Adam states are the only ones."""
    adapters = layer_adapter_params(arch, cfg, tp) * (arch.num_layers // pp)
    states = mem.training_state_bytes(adapters, dtype, dp, distributed_optimizer)
    return {**states, "weights": base_weights + states["weights"]}
