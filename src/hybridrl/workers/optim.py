"""Optimizer and LR schedule of a trainable role.

On GPU this is megatron-core's optimizer (`get_megatron_optimizer`, distributed optimizer optional).
For fp16 its dynamic loss scaler multiplies the loss before backward through the model config's
`grad_scale_func` (set here, as Megatron-LM's training loop does) and skips the steps whose scaled
gradients overflowed while it lowers the scale. megatron-core's grad clipping asserts CUDA tensors,
so on CPU the same contract is met by torch AdamW plus a global grad-norm computed over the
model-parallel group (each parameter counted once); it has no loss scaler, so fp16 is refused there.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridrl.config import ConfigError, OptimConfig
from hybridrl.parallel.distributed import ParallelGroups


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup, then constant / linear / cosine decay to lr * min_lr_ratio."""
    if cfg.lr_warmup_steps and step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay_style == "constant" or total_steps <= cfg.lr_warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.lr_warmup_steps) / max(1, total_steps - cfg.lr_warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_decay_style == "linear":
        return floor + (cfg.lr - floor) * (1.0 - progress)
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _counts_once(param, groups: ParallelGroups) -> bool:
    """Replicated params (norms, biases of row-parallel layers) are counted on TP rank 0 only; the
    tied output layer copy on the last stage is skipped (its twin lives on the first stage)."""
    if getattr(param, "shared", False) and groups.pp > 1 and groups.is_last_stage and not groups.is_first_stage:
        return False
    return getattr(param, "tensor_model_parallel", False) or groups.tp_rank == 0


class LRSchedule:
    """Where a role is in its LR schedule: one position per training step (as verl steps its scheduler),
    however many optimizer steps (mini-batches x ppo_epochs) a training step takes."""
    cfg: OptimConfig
    total_steps: int
    schedule_step: int = 0

    def current_lr(self) -> float:
        return lr_at(self.schedule_step, self.cfg, self.total_steps)

    def advance_schedule(self) -> None:
        self.schedule_step += 1


class CpuOptimizer(LRSchedule):
    """torch AdamW over megatron DDP's main_grad buffers, with a global grad-norm clip."""

    def __init__(self, module, cfg: OptimConfig, groups: ParallelGroups, total_steps: int):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.cfg, self.groups, self.total_steps = cfg, groups, total_steps
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                     weight_decay=cfg.weight_decay)
        self.step_count = 0

    def grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for p in self.params:
            if p.grad is not None and _counts_once(p, self.groups):
                sq += p.grad.detach().double().pow(2).sum()
        if dist.is_initialized() and dist.get_world_size(self.groups.mp_group) > 1:
            dist.all_reduce(sq, group=self.groups.mp_group)
        return math.sqrt(sq.item())

    def step(self):
        """Returns (updated, grad_norm, lr); not updated when the norm is not finite."""
        for p in self.params:
            main = getattr(p, "main_grad", None)
            if main is not None:
                p.grad = main.to(p.dtype)
        norm = self.grad_norm()
        lr = self.current_lr()
        if not math.isfinite(norm):
            return False, norm, lr
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step_count += 1
        return True, norm, lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _init_state(self) -> None:
        """AdamW's state as its first step creates it (step 0, zero moments): the placeholders a
        sharded load fills in, and what a save writes before the first update."""
        for p in self.params:
            state = self.optimizer.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                             exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """The AdamW moments as ShardedTensors laid out like their parameters, under megatron's names
        (`optimizer.state.exp_avg.<param key>`), so they load at any TP x PP x DP. AdamW's per-parameter
        `step` equals `step_count` (every parameter is stepped together) and is stored once."""
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                optim_state_to_sharding_state)

        self._init_state()
        state = self.optimizer.state_dict()
        id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        if len(id_to_sharded) != len(self.params):
            raise RuntimeError(f"{len(self.params) - len(id_to_sharded)} optimized parameters are missing "
                               f"from the model's sharded state dict")
        optim_state_to_sharding_state(state, id_to_sharded, exclude_keys=("step",))
        return {"optimizer": state, "step_count": self.step_count, "schedule_step": self.schedule_step}

    def load_sharded_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self.schedule_step = int(state["schedule_step"])
        for param_state in state["optimizer"]["state"].values():
            param_state["step"] = torch.tensor(float(self.step_count))
        self.optimizer.load_state_dict(state["optimizer"])


# fp16's dynamic loss scale starts here (Megatron-LM's 2**32 would skip the first ~30 steps of a
# short RL run while it halves its way down)
INITIAL_LOSS_SCALE = 2.0 ** 16


class MegatronOptimizer(LRSchedule):
    """megatron-core's optimizer (CUDA): mixed precision, fp16 loss scaling, distributed optimizer, clipping."""

    # how megatron's optimizers describe their state for dist_checkpointing (save and load alike)
    CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}

    def __init__(self, module, cfg: OptimConfig, use_distributed_optimizer: bool, total_steps: int, dtype):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config

        fp16 = dtype is torch.float16
        ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                               adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
                               clip_grad=cfg.clip_grad, bf16=dtype is torch.bfloat16, fp16=fp16,
                               params_dtype=dtype, use_distributed_optimizer=use_distributed_optimizer,
                               initial_loss_scale=INITIAL_LOSS_SCALE)
        self.optimizer = get_megatron_optimizer(ocfg, [module])
        # the schedules multiply each micro-batch loss by this before backward (1 without a scaler)
        get_model_config(module).grad_scale_func = self.optimizer.scale_loss
        self.skips_overflow_steps = fp16
        """A step that finds inf/NaN in fp16 gradients is skipped (the scale drops), not an error."""
        self.cfg, self.total_steps, self.step_count = cfg, total_steps, 0

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.get_loss_scale())

    def step(self):
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        updated, norm, _ = self.optimizer.step()
        self.step_count += int(bool(updated))
        return bool(updated), float(norm if norm is not None else float("nan")), lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """megatron's own optimizer sharded state dict. The distributed optimizer's param_state (fp32
        master shards, Adam moments: what its plain `state_dict()` leaves out) is written in the
        `fully_reshardable` format, parameter-shaped like the CPU path, so it loads at any layout."""
        return {"optimizer": self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                                               metadata=self.CHECKPOINT_METADATA),
                "step_count": self.step_count, "schedule_step": self.schedule_step}

    def load_sharded_state_dict(self, state: dict) -> None:
        # DistributedOptimizer.load_state_dict restores param_state into its fp32 main shards; the
        # mixed-precision optimizers copy main params back into the model on their next step.
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        self.schedule_step = int(state["schedule_step"])


def build_optimizer(module, cfg: OptimConfig, groups: ParallelGroups, total_steps: int,
                    use_distributed_optimizer: bool = False, dtype=torch.float32):
    if torch.cuda.is_available():
        return MegatronOptimizer(module, cfg, use_distributed_optimizer, total_steps, dtype)
    if dtype is torch.float16:
        raise ConfigError("model.params_dtype=float16 trains only with megatron-core's loss scaler, which "
                          "needs CUDA; use model.params_dtype=bfloat16 (or float32 on CPU)")
    return CpuOptimizer(module, cfg, groups, total_steps)
