"""Optimizer and LR schedule of a trainable role.

On GPU this is megatron-core's optimizer (`get_megatron_optimizer`, distributed optimizer optional).
For fp16 its dynamic loss scaler multiplies the loss before backward through the model config's
`grad_scale_func` (set here, as Megatron-LM's training loop does) and skips the steps whose scaled
gradients overflowed while it lowers the scale. megatron-core's grad clipping asserts CUDA tensors,
so on CPU the same contract is met by torch AdamW plus a global grad-norm computed over the
model-parallel group (each parameter counted once); it has no loss scaler, so fp16 is refused there.

Both paths leave 1-D parameters (norms) and biases undecayed, as megatron's own scheduler does
through its `wd_mult=0` parameter group (`set_group_hyperparams`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from hybridrl.config import ConfigError, OptimConfig
from hybridrl.parallel.distributed import ParallelGroups


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """optim.lr_warmup_steps, or where it is <= 0 lr_warmup_steps_ratio of the run's steps (as verl)."""
    return cfg.lr_warmup_steps if cfg.lr_warmup_steps > 0 else int(cfg.lr_warmup_steps_ratio * total_steps)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The LR of the update at schedule position `step` (0 for the first), as megatron-core's
    OptimizerParamScheduler gives it with lr_decay_steps = total_steps (verl's Megatron scheduler): linear
    warmup from lr_warmup_init at step 0 to lr at step W, then constant / linear / cosine decay to
    lr * min_lr_ratio at total_steps. A run no longer than its warmup stays at lr once warmed up."""
    warmup = warmup_steps(cfg, total_steps)
    if warmup and step < warmup:
        return cfg.lr_warmup_init + (cfg.lr - cfg.lr_warmup_init) * step / warmup
    if cfg.lr_decay_style == "constant" or total_steps <= warmup:
        return cfg.lr
    progress = min(1.0, (step - warmup) / (total_steps - warmup))
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


def no_weight_decay(name: str, param) -> bool:
    """megatron's default rule (Megatron-LM's and verl's too): norms (1-D) and biases are not decayed."""
    return param.dim() == 1 or name.endswith(".bias")


def set_group_hyperparams(param_groups, lr: float, weight_decay: float) -> None:
    """What megatron's scheduler sets on every step: each group's lr and weight decay times the group's
    multipliers (`wd_mult` is 0 in the group of norms and biases)."""
    for group in param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def init_adam_state(optimizer: torch.optim.Optimizer, step: float = 0.0) -> None:
    """Fill in what Adam's first step would create and is still missing: `step` and zero moments.
    A sharded load needs these placeholders, and a save before the first update writes them."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(float(step))
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


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
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        param_groups = [{"params": [p for n, p in named if no_weight_decay(n, p) == skip], "wd_mult": float(not skip)}
                        for skip in (False, True)]
        param_groups = [g for g in param_groups if g["params"]]
        self.params = [p for g in param_groups for p in g["params"]]  # the optimizer's order (its state ids)
        self.cfg, self.groups, self.total_steps = cfg, groups, total_steps
        self.optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                           weight_decay=cfg.weight_decay)
        self.step_count = 0

    def grad_norm(self) -> float:
        """The global grad norm: every parameter once over TP x PP; MoE experts (megatron marks them
        `allreduce=False`) differ between expert-parallel ranks, so theirs is summed over EP as well."""
        sq = torch.zeros(2, dtype=torch.float64, device=self.params[0].device)  # [dense, experts]
        for p in self.params:
            if p.grad is not None and _counts_once(p, self.groups):
                sq[int(not getattr(p, "allreduce", True))] += p.grad.detach().double().pow(2).sum()
        if dist.is_initialized() and dist.get_world_size(self.groups.mp_group) > 1:
            dist.all_reduce(sq, group=self.groups.mp_group)
        if self.groups.ep > 1:
            dist.all_reduce(sq[1:], group=self.groups.ep_group)
        return math.sqrt(sq.sum().item())

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
        set_group_hyperparams(self.optimizer.param_groups, lr, self.cfg.weight_decay)
        self.optimizer.step()
        self.step_count += 1
        return True, norm, lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """The AdamW moments as ShardedTensors laid out like their parameters, under megatron's names
        (`optimizer.state.exp_avg.<param key>`), so they load at any TP x PP x DP. AdamW's per-parameter
        `step` equals `step_count` (every parameter is stepped together) and is stored once."""
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                optim_state_to_sharding_state)

        init_adam_state(self.optimizer)
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
        for member in self.optimizer.chained_optimizers:
            map_states_in_inner_order(member)
        # the schedules multiply each micro-batch loss by this before backward (1 without a scaler)
        get_model_config(module).grad_scale_func = self.optimizer.scale_loss
        self.skips_overflow_steps = fp16
        """A step that finds inf/NaN in fp16 gradients is skipped (the scale drops), not an error."""
        self.cfg, self.total_steps, self.step_count = cfg, total_steps, 0

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.get_loss_scale())

    def _torch_optimizers(self) -> list:
        return [m.optimizer for m in self.optimizer.chained_optimizers if getattr(m, "optimizer", None) is not None]

    @torch.no_grad()
    def step(self):
        """megatron's ChainedOptimizer.step plus the CPU path's check: a non-finite grad norm stops the
        step before anything is applied (without a loss scaler megatron sees no overflow, and a NaN
        norm is never above clip_grad). Returns (updated, grad_norm, lr)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        lr = self.current_lr()
        set_group_hyperparams(self.optimizer.param_groups, lr, self.cfg.weight_decay)
        if self.optimizer.prepare_grads():  # fp16: the scaler found inf/NaN and lowers its scale
            return False, float("nan"), lr
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            return False, norm, lr
        if self.cfg.clip_grad > 0:
            for member in self.optimizer.chained_optimizers:
                params = [] if getattr(member, "is_stub_optimizer", False) else member.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=self.cfg.clip_grad, total_norm=norm)
        updated = bool(self.optimizer.step_with_ready_grads())
        self.step_count += int(updated)
        return updated, norm, lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """megatron's own optimizer sharded state dict. The distributed optimizer's param_state (fp32
        master shards, Adam moments: what its plain `state_dict()` leaves out) is written in the
        `fully_reshardable` format, parameter-shaped like the CPU path, so it loads at any layout.
        Adam's state is filled in first: before the first update torch's AdamW has none, and the
        distributed optimizer's `state_dict()` asserts one `step` in it (without TE or apex)."""
        for inner in self._torch_optimizers():
            init_adam_state(inner)
        return {"optimizer": self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                                               metadata=self.CHECKPOINT_METADATA),
                "step_count": self.step_count, "schedule_step": self.schedule_step}

    def load_sharded_state_dict(self, state: dict) -> None:
        # DistributedOptimizer.load_state_dict restores param_state into its fp32 main shards; the
        # mixed-precision optimizers copy main params back into the model on their next step.
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.step_count = int(state["step_count"])
        self.schedule_step = int(state["schedule_step"])
        members = self.optimizer.chained_optimizers
        parts = [state["optimizer"]] if len(members) == 1 else [state["optimizer"][i] for i in range(len(members))]
        for member, part in zip(members, parts):
            if not isinstance(member, DistributedOptimizer):  # megatron writes no step 0 (`if step:`);
                inner = part.get("optimizer", part)  # torch's AdamW refuses states without one
                inner["state"].setdefault("common_step", torch.tensor(float(self.step_count)))
        self.optimizer.load_state_dict(state["optimizer"])
        for inner in self._torch_optimizers():  # the distributed optimizer gives every state one `step`
            for param_state in inner.state.values():  # tensor, which AdamW would advance once per parameter
                param_state["step"] = param_state["step"].detach().clone()


def map_states_in_inner_order(member) -> None:
    """Make megatron's mixed-precision optimizers find each parameter's state where their inner torch
    optimizer keeps it when the model mixes dtypes (the local layer spec keeps norms in fp32 in a bf16
    model). Both assume one dtype: the distributed optimizer indexes states in the DDP buffer's order
    although its groups list fp32 shards first (its checkpoints then read other parameters' states),
    and the other one maps states through its 16-bit parameters alone (`mixed_precision_sharded_state`).
    The distributed optimizer's load also copies every state key of torch's AdamW from the checkpoint's
    tensors, which never hold `step` (it comes from the param groups): the copy leaves `step` alone."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if isinstance(member, DistributedOptimizer):
        groups = zip(member.model_fp32_groups, member.model_float16_groups)
        member.model_param_group_index_map = {p: (g, i) for g, (fp32, half) in enumerate(groups)
                                              for i, p in enumerate([*fp32, *half])}
        member._set_main_param_and_optimizer_states = functools.partial(
            _set_states_but_step, member, member._set_main_param_and_optimizer_states)
    elif isinstance(member, Float16OptimizerWithFloat16Params):
        member.sharded_state_dict = functools.partial(mixed_precision_sharded_state, member)


def _set_states_but_step(member, set_states, model_param, tensors) -> None:
    g, i = member.model_param_group_index_map[model_param]
    state = member.optimizer.state[member.optimizer.param_groups[g]["params"][i]]
    step = state.pop("step", None)
    try:
        set_states(model_param, tensors)
    finally:
        if step is not None:
            state["step"] = step


def mixed_precision_sharded_state(member, model_sharded_state_dict: dict, is_loading: bool = False,
                                  metadata: dict | None = None) -> dict:
    """megatron's Float16OptimizerWithFloat16Params.sharded_state_dict, with each optimizer state
    mapped to its model parameter in the inner optimizer's order. megatron's maps ids through the
    half-precision parameters alone, so fp32 parameters among them (the local layer spec's norms)
    shift every later state onto another parameter. Same keys as megatron's."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            make_sharded_optimizer_tensor,
                                                            optim_state_to_sharding_state)

    state = member.state_dict()
    model_params, masters = [], []  # per inner parameter its model parameter; (state id, group, fp32 master)
    for g, group in enumerate(member.optimizer.param_groups):
        half_of = {id(m): h for m, h in zip(member.fp32_from_float16_groups[g], member.float16_groups[g])}
        for p in group["params"]:
            if id(p) in half_of:
                masters.append((len(model_params), g, p))
            model_params.append(half_of.get(id(p), p))
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
    fp32 = [[] for _ in member.fp32_from_float16_groups]
    for i, g, master in masters:
        fp32[g].append(make_sharded_optimizer_tensor(id_map[i], master, prefix="optimizer.state.fp32_param"))
    state["fp32_from_fp16_params"] = fp32
    step = member._extract_common_per_param_step(state["optimizer"])
    optim_state_to_sharding_state(state["optimizer"], id_map, exclude_keys="step")
    if step:
        state["optimizer"]["state"]["common_step"] = step
    return state


def build_optimizer(module, cfg: OptimConfig, groups: ParallelGroups, total_steps: int,
                    use_distributed_optimizer: bool = False, dtype=torch.float32):
    if torch.cuda.is_available():
        return MegatronOptimizer(module, cfg, use_distributed_optimizer, total_steps, dtype)
    if dtype is torch.float16:
        raise ConfigError("model.params_dtype=float16 trains only with megatron-core's loss scaler, which "
                          "needs CUDA; use model.params_dtype=bfloat16 (or float32 on CPU)")
    return CpuOptimizer(module, cfg, groups, total_steps)
