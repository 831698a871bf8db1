"""Layout planner: process groups and a per-GPU memory estimate for a config at a world size.

`plan(cfg, world_size) -> Plan` lists which global ranks form each TP, PP, DP (and rollout TP)
group, estimates memory per GPU for every phase of a hybrid-engine step, and raises `PlanError`
(naming the biggest consumer and the fix) when the peak exceeds `parallel.gpu_memory_gb`.
`Plan.render()` is the text that `scripts/plan_layout.py` and the trainer's `--dry-run` print.
It creates no process groups and touches no GPU; the formulas live in `hybridrl.planner_memory`.

Hybrid engine: actor, critic, reference and rollout engine share every GPU and run one after the
other, so the peak is the maximum over phases (rollout, log-probs, critic update, actor update),
not the sum; the critic's value forward is smaller than its update and not listed. A role that is
idle in a phase keeps on the GPU only what its offload flags leave there (`actor.offload.*`,
`critic.offload.*`, `ref.offload_params`); a role at work has all of its state on the GPU. The
vLLM pool (`rollout.gpu_memory_utilization` of the GPU: engine weights at rollout TP + KV cache)
is held during rollout, and during training too when `rollout.free_cache_engine` is false. Every
phase adds a fixed runtime overhead (CUDA context, NCCL buffers, allocator slack). Each phase is
evaluated on the first pipeline stage (embedding, most in-flight micro batches) and the last
(head, logits); the worse one is reported.
With reward_model.enable a "reward model" phase scores the responses; elsewhere its weights stay on
the GPU unless `reward_model.offload_params`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from hybridrl import planner_memory as mem
from hybridrl.config import Config, ConfigError
from hybridrl.layout import Layout, derive_layout

GIB = mem.GIB
RUNTIME_OVERHEAD_GIB = 2.0
"""CUDA context, NCCL buffers and allocator fragmentation, per GPU."""
VLLM_WORKSPACE_GIB = 1.5
"""vLLM's profiled activation peak inside its pool (the rest of the pool after weights is KV cache)."""


class PlanError(ConfigError):
    """A layout that cannot run: it does not fit the GPU; the message names the consumer and fix."""


@dataclass(frozen=True)
class RankGroups:
    """Global ranks of each group, in megatron-core's order of group creation."""
    tp: Tuple[Tuple[int, ...], ...]
    pp: Tuple[Tuple[int, ...], ...]
    dp: Tuple[Tuple[int, ...], ...]
    rollout_tp: Tuple[Tuple[int, ...], ...]


def rank_groups(world_size: int, tp: int, pp: int, rollout_tp: int = 1) -> RankGroups:
    """Groups as `parallel_state.initialize_model_parallel` builds them with its default order
    "tp-cp-ep-dp-pp" (cp = ep = 1): rank = tp_rank + tp·dp_rank + tp·dp·pp_rank, so TP ranks are
    contiguous, then DP, then PP; the first listed dimension varies fastest over groups, as in
    megatron's `RankGenerator`. Rollout engines take contiguous blocks of rollout_tp ranks."""
    dp = world_size // (tp * pp)

    def rank(t, d, p):
        return t + tp * d + tp * dp * p

    return RankGroups(
        tp=tuple(tuple(rank(t, d, p) for t in range(tp)) for p in range(pp) for d in range(dp)),
        pp=tuple(tuple(rank(t, d, p) for p in range(pp)) for d in range(dp) for t in range(tp)),
        dp=tuple(tuple(rank(t, d, p) for d in range(dp)) for p in range(pp) for t in range(tp)),
        rollout_tp=tuple(tuple(range(i, i + rollout_tp)) for i in range(0, world_size, rollout_tp)))


@dataclass(frozen=True)
class Phase:
    """What one GPU holds during one phase of a step: (consumer "role/kind", bytes) pairs."""
    name: str
    stage: int
    items: Tuple[Tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(b for _, b in self.items)

    @property
    def biggest(self) -> Tuple[str, float]:
        return max(self.items, key=lambda item: item[1])

    def bytes(self, prefix: str) -> float:
        """Sum of the consumers whose name starts with prefix ("actor/", "actor/weights")."""
        return sum(b for name, b in self.items if name.startswith(prefix))


@dataclass(frozen=True)
class KVCache:
    """The rollout engine's KV cache on one GPU."""
    bytes: float
    bytes_per_sequence: float
    sequences_needed: int
    """Responses one engine generates per step (all of them in flight at once when they fit)."""

    @property
    def sequences(self) -> int:
        return int(self.bytes // self.bytes_per_sequence)


@dataclass(frozen=True)
class Plan:
    layout: Layout
    groups: RankGroups
    gpus_per_node: int
    gpu_memory_bytes: float
    model_params: int
    seq_len: int
    phases: Tuple[Phase, ...]
    kv_cache: KVCache
    notes: Tuple[str, ...]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.gpu_memory_bytes and self.kv_cache.sequences >= 1

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def render(self) -> str:
        return _render(self)


@dataclass(frozen=True)
class _Ctx:
    """Everything the phase builders need, derived once."""
    cfg: Config
    arch: mem.Arch
    layout: Layout
    seq: int
    dtype: str
    gpu_bytes: float
    uses_ref: bool
    rm_arch: Optional[mem.Arch] = None
    """The reward model's architecture when reward_model.enable."""


def _states(ctx: _Ctx, stage: int, critic: bool) -> dict:
    n = mem.stage_params(ctx.arch, ctx.layout.tp, ctx.layout.pp, stage, critic)
    return mem.training_state_bytes(n, ctx.dtype, ctx.layout.dp, ctx.cfg.parallel.use_distributed_optimizer)


def _idle(role: str, states: dict, offload) -> List[Tuple[str, float]]:
    """What an idle actor/critic keeps on the GPU: each state not offloaded by its flag."""
    kept = {"weights": not offload.params, "grads": not offload.grads, "optimizer": not offload.optimizer}
    return [(f"{role}/{kind}", b) for kind, b in states.items() if kept[kind]]


def _background(ctx: _Ctx, stage: int, busy: str) -> List[Tuple[str, float]]:
    """Consumers of the roles not running in this phase, plus the runtime overhead."""
    cfg = ctx.cfg
    items = [("runtime/overhead", RUNTIME_OVERHEAD_GIB * GIB)]
    if busy != "actor":
        items += _idle("actor", _states(ctx, stage, False), cfg.actor.offload)
    if busy != "critic" and cfg.algorithm.uses_critic:
        items += _idle("critic", _states(ctx, stage, True), cfg.critic.offload)
    if busy != "ref" and ctx.uses_ref and not cfg.ref.offload_params:
        items.append(("ref/weights", _states(ctx, stage, False)["weights"]))
    if busy != "reward_model" and ctx.rm_arch is not None and not cfg.reward_model.offload_params:
        items.append(("reward_model/weights", _reward_model_weights(ctx, stage)))
    if busy != "rollout" and cfg.rollout.name == "vllm" and not cfg.rollout.free_cache_engine:
        items.append(("rollout/vllm_pool", cfg.rollout.gpu_memory_utilization * ctx.gpu_bytes))
    return items


def _rollout_phase(ctx: _Ctx, stage: int) -> Phase:
    cfg, lay = ctx.cfg, ctx.layout
    items = _background(ctx, stage, "rollout")
    if cfg.rollout.name == "vllm":
        items.append(("rollout/vllm_pool", cfg.rollout.gpu_memory_utilization * ctx.gpu_bytes))
        items.append(("rollout/weight_sync_bucket", cfg.rollout.update_weights_bucket_mb * 2 ** 20))
    else:  # the native engine holds its own copy (all layers, rollout TP, PP 1) and a KV cache of its slots
        rtp = lay.rollout_tp
        items.append(("rollout/engine_weights", mem.total_params(ctx.arch) * mem.BYTES_PER_ELEMENT[ctx.dtype] / rtp))
        kv = mem.kv_bytes_per_token(ctx.arch, rtp, 1, ctx.dtype) * ctx.seq
        items.append(("rollout/kv_cache", kv * _native_slots(ctx)))
    return Phase("rollout", stage, tuple(items))


def _forward_phase(ctx: _Ctx, stage: int, role: str) -> Phase:
    """Log-probs of the actor (old) or the reference: weights plus one micro batch's forward."""
    micro = (ctx.cfg.actor if role == "actor" else ctx.cfg.ref).log_prob_micro_batch_size_per_gpu
    items = _background(ctx, stage, role)
    states = _states(ctx, stage, False)
    if role == "actor":  # its grads and optimizer states stay wherever its offload flags put them
        items.append(("actor/weights", states["weights"]))
        items += [item for item in _idle("actor", states, ctx.cfg.actor.offload) if item[0] != "actor/weights"]
    else:
        items.append(("ref/weights", states["weights"]))
    last = stage == ctx.layout.pp - 1
    forward = mem.forward_bytes(ctx.arch, ctx.seq, micro, ctx.layout.tp, ctx.dtype, last_stage=last)
    items.append((f"{role}/forward", forward))
    return Phase(f"{role} log-prob", stage, tuple(items))


def _reward_model_arch(cfg: Config, actor: mem.Arch) -> Optional[mem.Arch]:
    """config.json at reward_model.path; the actor's architecture while that does not exist yet."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    if not os.path.isfile(os.path.join(rm.path, "config.json")):
        return actor
    return mem.arch_from_model_config(dataclasses.replace(cfg.model, path=rm.path))


def _reward_model_weights(ctx: _Ctx, stage: int) -> float:
    n = mem.stage_params(ctx.rm_arch, ctx.layout.tp, ctx.layout.pp, stage, critic=True)
    return n * mem.BYTES_PER_ELEMENT[ctx.dtype]


def _reward_model_phase(ctx: _Ctx, stage: int) -> Phase:
    """The reward model scoring: its weights plus one micro batch's forward (a scalar head, no logits)."""
    rm = ctx.cfg.reward_model
    items = _background(ctx, stage, "reward_model") + [("reward_model/weights", _reward_model_weights(ctx, stage))]
    forward = mem.forward_bytes(ctx.rm_arch, rm.max_length or ctx.seq, rm.micro_batch_size_per_gpu, ctx.layout.tp,
                                ctx.dtype, last_stage=stage == ctx.layout.pp - 1, scalar_head=True)
    return Phase("reward model", stage, tuple(items + [("reward_model/forward", forward)]))


def _update_phase(ctx: _Ctx, stage: int, role: str) -> Phase:
    """One role's optimizer step: all its states, its saved activations, the rest in background."""
    critic = role == "critic"
    rcfg = ctx.cfg.critic if critic else ctx.cfg.actor
    lay, micro = ctx.layout, rcfg.ppo_micro_batch_size_per_gpu
    mini = lay.critic_mini_batch_samples if critic else lay.actor_mini_batch_samples
    in_flight = min(lay.pp - stage, mini // (lay.dp * micro))
    items = _background(ctx, stage, role)
    items += [(f"{role}/{k}", b) for k, b in _states(ctx, stage, critic).items()]
    acts = mem.stage_activation_bytes(ctx.arch, ctx.seq, micro, lay.tp, lay.pp, in_flight,
                                      ctx.cfg.parallel.recompute_activations, ctx.dtype)
    items.append((f"{role}/activations", acts))
    if stage == lay.pp - 1:
        head = mem.head_activation_bytes(ctx.arch, ctx.seq, micro, lay.tp, ctx.dtype, critic)
        items.append((f"{role}/{'value_head' if critic else 'logits'}", head))
    return Phase(f"{role} update", stage, tuple(items))


def _stage_phases(ctx: _Ctx, stage: int) -> List[Phase]:
    phases = [_rollout_phase(ctx, stage)]
    if ctx.rm_arch is not None:
        phases.append(_reward_model_phase(ctx, stage))
    phases.append(_forward_phase(ctx, stage, "actor"))
    if ctx.uses_ref:
        phases.append(_forward_phase(ctx, stage, "ref"))
    if ctx.cfg.algorithm.uses_critic:
        phases.append(_update_phase(ctx, stage, "critic"))
    phases.append(_update_phase(ctx, stage, "actor"))
    return phases


def _native_slots(ctx: _Ctx) -> int:
    """KV-cache slots of the native engine: rollout.max_num_seqs, or fewer when fewer rows come."""
    return min(ctx.cfg.rollout.max_num_seqs, ctx.layout.samples_per_step_per_dp)


def _kv_cache(ctx: _Ctx) -> KVCache:
    cfg, lay = ctx.cfg, ctx.layout
    if cfg.rollout.name == "native":
        per_seq = mem.kv_bytes_per_token(ctx.arch, lay.rollout_tp, 1, ctx.dtype) * ctx.seq
        return KVCache(per_seq * _native_slots(ctx), per_seq, _native_slots(ctx))
    rtp = lay.rollout_tp
    weights = mem.total_params(ctx.arch) * mem.BYTES_PER_ELEMENT[ctx.dtype] / rtp
    pool = cfg.rollout.gpu_memory_utilization * ctx.gpu_bytes
    per_seq = mem.kv_bytes_per_token(ctx.arch, rtp, 1, ctx.dtype) * ctx.seq
    needed = lay.samples_per_step // (lay.world_size // rtp)
    return KVCache(max(pool - weights - VLLM_WORKSPACE_GIB * GIB, 0.0), per_seq, needed)


def _notes(ctx: _Ctx, gpus_per_node: int, kv: KVCache) -> Tuple[str, ...]:
    notes = []
    lay = ctx.layout
    if lay.tp > gpus_per_node or lay.rollout_tp > gpus_per_node:
        notes.append(f"TP groups span nodes (tp={lay.tp}, rollout tp={lay.rollout_tp}, {gpus_per_node} GPUs "
                     f"per node): TP all-reduces would cross the network; keep TP within a node")
    if 1 <= kv.sequences < kv.sequences_needed:
        notes.append(f"the KV cache holds {kv.sequences} of the {kv.sequences_needed} sequences each engine "
                     f"generates per step: generation runs in waves (raise rollout.gpu_memory_utilization "
                     f"or rollout.tensor_model_parallel_size for more at once)")
    return tuple(notes)


def estimate(cfg: Config, world_size: int, vocab_size: int = 0, gpus_per_node: int = 0) -> Plan:
    """The plan without the fit check (derive_layout's checks still apply)."""
    layout = derive_layout(cfg, world_size, vocab_size, allow_missing_path=True)
    arch = mem.arch_from_model_config(cfg.model, vocab_size)
    ctx = _Ctx(cfg, arch, layout, cfg.data.max_prompt_length + cfg.data.max_response_length,
               cfg.model.params_dtype, cfg.parallel.gpu_memory_gb * GIB,
               cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward, _reward_model_arch(cfg, arch))
    stages = sorted({0, layout.pp - 1})
    by_name = {}
    for stage in stages:  # the first stage holds the most in-flight micro batches, the last the logits
        for phase in _stage_phases(ctx, stage):
            if phase.name not in by_name or phase.total > by_name[phase.name].total:
                by_name[phase.name] = phase
    kv = _kv_cache(ctx)
    gpn = gpus_per_node or cfg.parallel.gpus_per_node
    return Plan(layout, rank_groups(world_size, layout.tp, layout.pp, layout.rollout_tp), gpn, ctx.gpu_bytes,
                mem.total_params(arch), ctx.seq, tuple(by_name.values()), kv, _notes(ctx, gpn, kv))


def plan(cfg: Config, world_size: int, vocab_size: int = 0, gpus_per_node: int = 0) -> Plan:
    """Groups and memory estimate of `cfg` on `world_size` GPUs; PlanError when it cannot fit."""
    p = estimate(cfg, world_size, vocab_size, gpus_per_node)
    peak = p.peak
    if peak.total > p.gpu_memory_bytes:
        name, size = peak.biggest
        raise PlanError(
            f"layout does not fit: phase '{peak.name}' (pipeline stage {peak.stage}) needs "
            f"{peak.total / GIB:.1f} GiB per GPU but parallel.gpu_memory_gb={cfg.parallel.gpu_memory_gb:g}; "
            f"biggest consumer {name} = {size / GIB:.1f} GiB. Fix: {advice(name, peak.name, cfg)}")
    if p.kv_cache.sequences < 1:
        raise PlanError(
            f"the rollout KV cache ({p.kv_cache.bytes / GIB:.2f} GiB after the engine's weights) cannot hold one "
            f"sequence of {p.seq_len} tokens ({p.kv_cache.bytes_per_sequence / GIB:.2f} GiB). Fix: raise "
            f"rollout.gpu_memory_utilization or rollout.tensor_model_parallel_size, or shorten data.max_*_length")
    return p


def advice(consumer: str, phase: str, cfg: Config) -> str:
    """The config changes that shrink `consumer` in `phase`, most effective first."""
    role, kind = consumer.split("/", 1)
    during_rollout = phase == "rollout"
    more_mp = "raise parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size"
    fixes = []
    if kind == "optimizer":
        if not cfg.parallel.use_distributed_optimizer:
            fixes.append("set parallel.use_distributed_optimizer=true")
        fixes += [f"set {role}.offload.optimizer=true"] if during_rollout else []
        fixes += [more_mp, "or use more nodes (a larger DP shards the distributed optimizer further)"]
    elif kind in ("weights", "grads"):
        if role in ("ref", "reward_model"):
            fixes.append(f"set {role}.offload_params=true")
        elif during_rollout:
            fixes.append(f"set {role}.offload.{'params' if kind == 'weights' else 'grads'}=true")
        fixes.append(more_mp)
    elif kind in ("activations", "logits", "value_head"):
        if kind == "activations" and not cfg.parallel.recompute_activations:
            fixes.append("set parallel.recompute_activations=true")
        fixes += [f"lower {role}.ppo_micro_batch_size_per_gpu", more_mp]
    elif kind == "forward":
        micro = "micro_batch_size_per_gpu" if role == "reward_model" else "log_prob_micro_batch_size_per_gpu"
        fixes += [f"lower {role}.{micro}", more_mp]
    elif kind == "vllm_pool":
        fixes += ["lower rollout.gpu_memory_utilization",
                  "offload the idle training state during rollout (actor.offload.params/grads/optimizer=true)"]
        if not cfg.rollout.free_cache_engine:
            fixes.insert(0, "set rollout.free_cache_engine=true")
    elif kind == "kv_cache":
        fixes += ["use rollout.name=vllm", "lower data.train_batch_size or rollout.n", more_mp]
    else:
        fixes.append(more_mp)
    return "; ".join(fixes)


def _fmt_groups(name: str, groups, limit: int = 8) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    more = f" ... (+{len(groups) - limit} more)" if len(groups) > limit else ""
    return f"  {name:<11} {len(groups):>4} x {len(groups[0])}: {shown}{more}"


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def _render(p: Plan) -> str:
    lay = p.layout
    nodes = -(-lay.world_size // p.gpus_per_node)
    lines = [f"layout: {lay.describe()}; {nodes} node(s) x {p.gpus_per_node} GPUs; model "
             f"{p.model_params / 1e9:.2f}B params, sequence {p.seq_len} tokens",
             "process groups (megatron-core order tp-cp-ep-dp-pp: rank = tp_rank + tp*dp_rank + tp*dp*pp_rank):",
             _fmt_groups("TP", p.groups.tp), _fmt_groups("PP", p.groups.pp), _fmt_groups("DP", p.groups.dp),
             _fmt_groups("rollout TP", p.groups.rollout_tp),
             "memory per GPU (hybrid engine: phases run one after another, peak = max over phases;"
             " idle roles keep what their offload flags leave on the GPU):"]
    peak = p.peak
    for phase in p.phases:
        mark = "   <- peak" if phase is peak else ""
        lines.append(f"  {phase.name} (pipeline stage {phase.stage}): {_size(phase.total)}{mark}")
        lines += [f"      {name:<28} {_size(size):>11}" for name, size in phase.items]
    kv = p.kv_cache
    lines.append(f"rollout KV cache: {_size(kv.bytes)} = {kv.sequences} sequences of {p.seq_len} tokens "
                 f"({kv.sequences_needed} per engine per step)")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines.append(f"peak {_size(peak.total)} of {_size(p.gpu_memory_bytes)} "
                 f"({100 * peak.total / p.gpu_memory_bytes:.0f}%, phase '{peak.name}'): {verdict}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
