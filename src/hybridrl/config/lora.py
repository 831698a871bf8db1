"""Section actor.lora / critic.lora: low-rank adapters on the megatron linears (verl's model.lora.* names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from hybridrl.config.checks import check

# megatron module -> the HF modules it fuses (the names PEFT targets)
LORA_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
HF_LORA_MODULES = tuple(p for parts in LORA_MODULES.values() for p in parts)


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """Rank r of every adapter; 0: no LoRA (full fine-tuning)."""
    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank) * B @ A to its weight (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input (PEFT's lora_dropout)."""
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])
    """Adapted linears: megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2), HF names (q_proj, k_proj,
    v_proj, o_proj, gate_proj, up_proj, down_proj) or all-linear; an MoE model's experts are not adapted."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def hf_targets(self) -> tuple:
        """The HF module names adapted, in HF_LORA_MODULES order."""
        chosen = set()
        for name in self.target_modules:
            chosen.update(HF_LORA_MODULES if name == "all-linear" else LORA_MODULES.get(name, (name,)))
        return tuple(p for p in HF_LORA_MODULES if p in chosen)

    def __post_init__(self):
        check(self.rank >= 0, f"lora.rank={self.rank} must be >= 0 (0 turns LoRA off)")
        check(self.alpha > 0, f"lora.alpha={self.alpha} must be > 0")
        check(0.0 <= self.dropout < 1.0, f"lora.dropout={self.dropout} must be in [0, 1)")
        known = ("all-linear",) + tuple(LORA_MODULES) + HF_LORA_MODULES
        unknown = [n for n in self.target_modules if n not in known]
        check(not unknown, f"lora.target_modules has {unknown}; use names from {', '.join(known)}")
        check(not self.enabled or bool(self.target_modules), "lora.target_modules is empty; name at least one module")


def check_lora_run(run, is_moe: bool) -> None:
    """What a LoRA actor needs from the rest of the run `run` (a Config; layout.derive_layout calls this)."""
    cfg = run.actor.lora
    if not cfg.enabled:
        return
    check(run.rollout.name != "vllm", f"actor.lora.rank={cfg.rank} with rollout.name=vllm is not supported (the "
          "engine would need LoRA adapter loading); use rollout.name=native, which receives the merged weights")
    check(run.placement.mode == "colocated", f"actor.lora.rank={cfg.rank} with placement.mode={run.placement.mode} is "
          "not supported (its weight stream to the rollout ranks does not merge the adapters); use placement.mode="
          "colocated")
    uses_ref = run.actor.use_kl_loss or run.algorithm.use_kl_in_reward
    check(not (uses_ref and run.actor.offload.params), f"actor.lora.rank={cfg.rank}: the reference is the actor's base "
          "(adapters off), so its weights cannot leave the device in the reference pass; set actor.offload.params=false")
    mlp = sorted(n for n in cfg.target_modules if n in ("linear_fc1", "linear_fc2", "gate_proj", "up_proj", "down_proj"))
    check(not (is_moe and mlp), f"actor.lora.target_modules={mlp}: an MoE model's MLPs are its experts, which get no "
          "adapters; target the attention (linear_qkv, linear_proj or q/k/v/o_proj), or all-linear (attention only)")
