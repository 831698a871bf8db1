"""Layout planner: process groups and a per-GPU memory estimate for a config at a world size.

`plan(cfg, world_size) -> Plan` lists which global ranks form each TP, PP, DP (for MoE models EP
and expert DP; and rollout TP) group, estimates memory per GPU for every phase of a hybrid-engine
step, and raises `PlanError` (naming the biggest consumer and the fix) when the peak exceeds
`parallel.gpu_memory_gb`. `Plan.render()` is the text that `scripts/plan_layout.py` and the trainer's
`--dry-run` print (written by `hybridrl.planner.report`). It creates no process groups and touches no
GPU; the formulas live in `hybridrl.planner.memory`. MoE models are planned on their total parameters
(every expert is in memory), experts split over EP ranks, with their dispatch buffers in the updates.

Hybrid engine: actor, critic, reference and rollout engine share every GPU and run one after the
other, so the peak is the maximum over phases, not the sum. The phases are the trainer's, in its
order: rollout, actor log-prob, ref log-prob, critic values, critic update, actor update, weight
sync (and checkpoint when saving). In each, a role holds what `offload.HYBRID_PHASES` (the table
the trainer moves state by) needs there, plus whatever its offload flags leave on the device
(`actor.offload.*`, `critic.offload.*`, `ref.offload_params`). The rollout engine holds its weights
(and KV cache, or vLLM's `rollout.gpu_memory_utilization` pool) while generating and its weights in
the weight sync, beside the stream's bucket; in training phases nothing once it sleeps
(`rollout.free_cache_engine`), else its weights or whole pool. Every phase adds a fixed runtime
overhead (CUDA context, NCCL buffers, allocator slack). Each phase is evaluated on the first
pipeline stage (embedding, most in-flight micro batches) and the last (head, logits); the worse
one is reported.
With reward_model.enable a "reward model" phase scores the responses; elsewhere its weights stay on
the GPU unless `reward_model.offload_params`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from hybridrl.planner import memory as mem
from hybridrl.planner.lora_memory import lora_state_bytes
from hybridrl.planner.report import advice, render_plan
from hybridrl.config import Config, ConfigError, OffloadConfig
from hybridrl.config.layout import Layout, derive_layout
from hybridrl.placement.offload import HYBRID_PHASES, PARTS
from hybridrl.workers.critic import values_source
from hybridrl.config.batching import MicroBatching, resolve_batching

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
    ep: Tuple[Tuple[int, ...], ...] = ()
    """Ranks that split one MoE layer's experts (contiguous in DP)."""
    expert_dp: Tuple[Tuple[int, ...], ...] = ()
    """Ranks that hold the same experts (their grads are reduced and optimizer states sharded there)."""
    cp: Tuple[Tuple[int, ...], ...] = ()
    """Ranks that split one sequence (context parallelism); empty at CP 1."""


def rank_groups(world_size: int, tp: int, pp: int, rollout_tp: int = 1, ep: int = 1, cp: int = 1) -> RankGroups:
    """Groups as `parallel_state.initialize_model_parallel` builds them with its default order
    "tp-cp-ep-dp-pp": rank = tp_rank + tp·cp_rank + tp·cp·dp_rank + tp·cp·dp·pp_rank, so TP ranks are
    contiguous, then CP, DP, PP; the first listed dimension varies fastest over groups, as in megatron's
    `RankGenerator`. Experts (expert TP = TP) split the cp·dp ranks of a stage as ep_rank + ep·expert_dp_rank.
    Rollout engines take contiguous blocks of rollout_tp ranks."""
    dp = world_size // (tp * pp * cp)
    edp = dp * cp // ep

    def rank(t, d, p, c=0):
        return t + tp * c + tp * cp * d + tp * cp * dp * p

    def expert_rank(t, e, x, p):  # megatron's expert generator ("tp-ep-dp-pp") over the cp·dp ranks
        return t + tp * (e + ep * x) + tp * cp * dp * p

    return RankGroups(
        tp=tuple(tuple(rank(t, d, p, c) for t in range(tp)) for p in range(pp) for d in range(dp) for c in range(cp)),
        pp=tuple(tuple(rank(t, d, p, c) for p in range(pp)) for d in range(dp) for c in range(cp) for t in range(tp)),
        dp=tuple(tuple(rank(t, d, p, c) for d in range(dp)) for p in range(pp) for c in range(cp) for t in range(tp)),
        rollout_tp=tuple(tuple(range(i, i + rollout_tp)) for i in range(0, world_size, rollout_tp)),
        ep=tuple(tuple(expert_rank(t, e, x, p) for e in range(ep)) for p in range(pp) for x in range(edp)
                 for t in range(tp)),
        expert_dp=tuple(tuple(expert_rank(t, e, x, p) for x in range(edp)) for p in range(pp) for e in range(ep)
                        for t in range(tp)),
        cp=tuple(tuple(rank(t, d, p, c) for c in range(cp)) for p in range(pp) for d in range(dp) for t in range(tp))
        if cp > 1 else ())


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
    """All parameters, every expert included."""
    arch: mem.Arch
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
        return render_plan(self)


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
    split: mem.SeqSplit = mem.NO_SPLIT
    """How the training forwards spread a micro batch's tokens (SP, CP, packed rows)."""


def _states(ctx: _Ctx, stage: int, critic: bool) -> dict:
    lay, lora, distributed = ctx.layout, ctx.cfg.actor.lora, ctx.cfg.parallel.use_distributed_optimizer
    # megatron's distributed optimizer shards over the data-parallel ranks with the context-parallel ones
    states = mem.stage_state_bytes(ctx.arch, lay.tp, lay.pp, stage, lay.dp * lay.cp, lay.ep, ctx.dtype, distributed,
                                   critic)
    if critic or not lora.enabled:
        return states
    return lora_state_bytes(ctx.arch, lora, lay.tp, lay.pp, lay.dp * lay.cp, ctx.dtype, distributed, states["weights"])


STATE_KINDS = {"params": "weights", "grads": "grads", "optimizer": "optimizer"}
"""offload part -> the planner's consumer kind."""


def _roles(ctx: _Ctx) -> dict:
    """{role: (its OffloadConfig, critic trunk?)} of the trainable and frozen roles this config runs."""
    cfg, roles = ctx.cfg, {"actor": (ctx.cfg.actor.offload, False)}
    if cfg.algorithm.uses_critic:
        roles["critic"] = (cfg.critic.offload, True)
    if ctx.uses_ref:
        roles["ref"] = (OffloadConfig(params=cfg.ref.offload_params), False)
    if ctx.rm_arch is not None:
        roles["reward_model"] = (OffloadConfig(params=cfg.reward_model.offload_params), True)
    return roles


def shares_weights(cfg: Config, layout: Layout) -> bool:
    """The native engine reads the actor's own weights (`weight_sharing.shares_weights`): colocated, rollout TP =
    TP, PP 1, EP 1, rollout.share_weights (the engine runs in model.params_dtype), no LoRA (merged copies)."""
    return layout.pp == 1 and _engine_at_training_layout(cfg, layout)


def shares_stage(cfg: Config, layout: Layout) -> bool:
    """As `shares_weights` at PP > 1 (`weight_sharing.shares_stage`, a fingerprint check or none): the engine reads
    its own stage's layers from the actor and holds a copy of the other stages' only."""
    return layout.pp > 1 and cfg.rollout.verify_weights != "exact" and _engine_at_training_layout(cfg, layout)


def _engine_at_training_layout(cfg: Config, layout: Layout) -> bool:
    """A colocated native engine asked to share, without LoRA, at rollout TP = TP and EP 1."""
    return (cfg.rollout.name == "native" and cfg.rollout.share_weights and not layout.split
            and not cfg.actor.lora.enabled and layout.rollout_tp == layout.tp and layout.ep == 1)


def _role_states(ctx: _Ctx, stage: int, phase: str) -> List[Tuple[str, float]]:
    """What each role holds on the GPU in trainer phase `phase`: the parts `offload.HYBRID_PHASES`
    needs there (with shared weights, generation needs the actor's), plus every part its offload flags
    leave on the device (frozen roles have weights only)."""
    items = []
    for role, (offload, critic) in _roles(ctx).items():
        needed = HYBRID_PHASES[phase].get(role, ())
        if phase == "gen" and role == "actor" and (shares_weights(ctx.cfg, ctx.layout)
                                                   or shares_stage(ctx.cfg, ctx.layout)):
            needed = needed + ("params",)
        if role == "reward_model":
            states = {"weights": _reward_model_weights(ctx, stage)}
        else:
            states = _states(ctx, stage, critic)
        parts = ("params",) if role in ("ref", "reward_model") else PARTS
        items += [(f"{role}/{STATE_KINDS[part]}", states[STATE_KINDS[part]]) for part in parts
                  if part in needed or not getattr(offload, part)]
    return items


def _engine_weights(ctx: _Ctx, stage: int) -> float:
    """The rollout engine's own weight copy on a GPU of pipeline stage `stage`: none where it reads the actor's
    (`shares_weights`), the other stages' layers where it reads its own stage's (`shares_stage`)."""
    if shares_weights(ctx.cfg, ctx.layout):
        return 0.0
    if not shares_stage(ctx.cfg, ctx.layout):
        return _engine_copy(ctx)
    lay, arch = ctx.layout, ctx.arch
    read = mem.stage_params(arch, lay.tp, lay.pp, stage)
    if stage == lay.pp - 1 and arch.tie_word_embeddings:  # megatron's tied copy there: the engine reads stage 0's
        read -= arch.padded_vocab(lay.tp) * arch.hidden_size // lay.tp
    return max(0.0, _engine_copy(ctx) - read * mem.BYTES_PER_ELEMENT[ctx.dtype])


def _engine_copy(ctx: _Ctx) -> float:
    """A copy of the weights at rollout TP: all layers, PP 1 (the native engine is a megatron model
    with its padded vocabulary; vLLM's padding to 64 rows is negligible)."""
    rtp, e = ctx.layout.rollout_tp, mem.BYTES_PER_ELEMENT[ctx.dtype]
    if ctx.cfg.rollout.name == "native":
        return mem.stage_params(ctx.arch, rtp, 1, 0) * e
    return mem.total_params(ctx.arch) * e / rtp


def _engine_idle(ctx: _Ctx, stage: int) -> List[Tuple[str, float]]:
    """What the engine keeps during training phases: nothing once it sleeps (free_cache_engine; the
    native engine moves its weights off the GPU then), else its weights / vLLM's whole pool."""
    cfg = ctx.cfg
    if cfg.rollout.free_cache_engine:
        return []
    if cfg.rollout.name == "vllm":
        return [("rollout/vllm_pool", cfg.rollout.gpu_memory_utilization * ctx.gpu_bytes)]
    return [("rollout/engine_weights", _engine_weights(ctx, stage))]


def _base(ctx: _Ctx, stage: int, phase: str) -> List[Tuple[str, float]]:
    """Runtime overhead and the role states of a phase; the engine's idle share outside its phases."""
    items = [("runtime/overhead", RUNTIME_OVERHEAD_GIB * GIB)] + _role_states(ctx, stage, phase)
    return items + ([] if phase in ("gen", "update_weights") else _engine_idle(ctx, stage))


def _rollout_phase(ctx: _Ctx, stage: int) -> Phase:
    cfg, lay = ctx.cfg, ctx.layout
    items = _base(ctx, stage, "gen")
    if cfg.rollout.name == "vllm":
        items.append(("rollout/vllm_pool", cfg.rollout.gpu_memory_utilization * ctx.gpu_bytes))
    else:  # the native engine's weights (all layers, rollout TP, PP 1; none when shared) and a KV cache of its slots
        items.append(("rollout/engine_weights", _engine_weights(ctx, stage)))
        kv = mem.kv_bytes_per_token(ctx.arch, lay.rollout_tp, 1, ctx.dtype) * ctx.seq
        items.append(("rollout/kv_cache", kv * _native_slots(ctx)))
        prefill = mem.forward_bytes(ctx.arch, cfg.data.max_prompt_length, _native_slots(ctx),
                                    lay.rollout_tp, ctx.dtype)  # the prefill of a full set of slots
        items.append(("rollout/prefill", prefill))
    return Phase("rollout", stage, tuple(items))


def _weight_sync_phase(ctx: _Ctx, stage: int) -> Phase:
    """The handoff: the actor's weights, the engine's woken weights (vLLM wakes only those), and the
    stream's buffers: one bucket plus one full tensor, none where shards go straight into the engine."""
    cfg, lay = ctx.cfg, ctx.layout
    items = _base(ctx, stage, "update_weights") + (_engine_idle(ctx, stage)
                                                   or [("rollout/engine_weights", _engine_weights(ctx, stage))])
    direct = cfg.rollout.name == "native" and lay.rollout_tp == lay.tp and lay.pp == 1
    if not direct:
        largest = mem.largest_tensor_params(ctx.arch, lay.tp) * mem.BYTES_PER_ELEMENT[ctx.dtype]
        bucket = min(cfg.rollout.update_weights_bucket_mb * 2 ** 20, _engine_copy(ctx) * lay.rollout_tp)
        items.append(("rollout/weight_sync_buffers", bucket + largest))
    return Phase("weight sync", stage, tuple(items))


def _micro_rows(ctx: _Ctx, split: MicroBatching) -> float:
    """Full-width rows one micro-batch may compute: the row count, or with use_dynamic_bsz the
    token budget (per GPU x CP: whole rows) over the full width (the packer keeps rows x trimmed width within
    the budget, and the budget is at least one full row, so every activation term is bounded by this many rows)."""
    return split.max_tokens / ctx.seq if split.dynamic else split.rows


def _forward_phase(ctx: _Ctx, stage: int, role: str) -> Phase:
    """A forward without grad: the actor's old log-probs, the reference's, or the critic's values."""
    batching = resolve_batching(ctx.cfg)
    split = {"actor": batching.actor_log_prob, "ref": batching.ref_log_prob, "critic": batching.critic_values}[role]
    micro = _micro_rows(ctx, split) / ctx.layout.cp  # a GPU holds 1/cp of each row's tokens
    phase = {"actor": "old_log_prob", "ref": "ref", "critic": "values"}[role]
    items = _base(ctx, stage, phase)
    last = stage == ctx.layout.pp - 1
    forward = mem.forward_bytes(ctx.arch, ctx.seq, micro, ctx.layout.tp, ctx.dtype, last_stage=last,
                                scalar_head=role == "critic", response=ctx.cfg.data.max_response_length,
                                ep=ctx.layout.ep)
    items.append((f"{role}/forward", forward))
    return Phase(f"{role} values" if role == "critic" else f"{role} log-prob", stage, tuple(items))


def _reward_model_arch(cfg: Config, actor: mem.Arch) -> Optional[mem.Arch]:
    """config.json at reward_model.path; the actor's architecture while that does not exist yet."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    if not os.path.isfile(os.path.join(rm.path, "config.json")):
        return actor
    return mem.arch_from_model_config(dataclasses.replace(cfg.model, path=rm.path))


def _reward_model_weights(ctx: _Ctx, stage: int) -> float:
    n = mem.stage_params(ctx.rm_arch, ctx.layout.tp, ctx.layout.pp, stage, critic=True, ep=ctx.layout.ep)
    return n * mem.BYTES_PER_ELEMENT[ctx.dtype]


def _reward_model_phase(ctx: _Ctx, stage: int) -> Phase:
    """The reward model scoring: its weights plus one micro batch's forward (a scalar head, no logits)."""
    rm = ctx.cfg.reward_model
    items = _base(ctx, stage, "reward")
    forward = mem.forward_bytes(ctx.rm_arch, rm.max_length or ctx.seq, rm.micro_batch_size_per_gpu, ctx.layout.tp,
                                ctx.dtype, last_stage=stage == ctx.layout.pp - 1, scalar_head=True, ep=ctx.layout.ep)
    return Phase("reward model", stage, tuple(items + [("reward_model/forward", forward)]))


def _update_phase(ctx: _Ctx, stage: int, role: str) -> Phase:
    """One role's optimizer step: all its states, its saved activations, the others per their flags."""
    critic = role == "critic"
    batching = resolve_batching(ctx.cfg)
    lay, micro = ctx.layout, _micro_rows(ctx, batching.critic_update if critic else batching.actor_update)
    mini = lay.critic_mini_batch_samples if critic else lay.actor_mini_batch_samples
    in_flight = max(1, min(lay.pp - stage, int(mini // (lay.dp * micro))))
    items = _base(ctx, stage, f"update_{role}")
    aux_loss = not critic and ctx.cfg.actor.moe_aux_loss_coeff > 0
    acts = mem.stage_activation_bytes(ctx.arch, ctx.seq, micro, lay.tp, lay.pp, in_flight,
                                      ctx.cfg.parallel.recompute_activations, ctx.dtype, aux_loss, ctx.split)
    items.append((f"{role}/activations", acts))
    if ctx.arch.is_moe:  # one MoE layer's dispatch buffers at a time, forward and backward
        dispatch = mem.dispatch_bytes(ctx.arch, ctx.seq, micro / lay.cp, lay.tp, lay.ep, ctx.dtype)  # 1/cp of each row
        items.append((f"{role}/dispatch", dispatch))
    if stage == lay.pp - 1:
        head = mem.head_activation_bytes(ctx.arch, ctx.seq, micro, lay.tp, ctx.dtype, critic,
                                         response=ctx.cfg.data.max_response_length, split=ctx.split)
        items.append((f"{role}/{'value_head' if critic else 'logits'}", head))
    return Phase(f"{role} update", stage, tuple(items))


def _stage_phases(ctx: _Ctx, stage: int) -> List[Phase]:
    """The phases of one step in the trainer's order (PPOTrainer.train_step, then the weight sync)."""
    phases = [_rollout_phase(ctx, stage)]
    if ctx.rm_arch is not None:
        phases.append(_reward_model_phase(ctx, stage))
    phases.append(_forward_phase(ctx, stage, "actor"))
    if ctx.uses_ref:
        phases.append(_forward_phase(ctx, stage, "ref"))
    if ctx.cfg.algorithm.uses_critic:  # the values pass runs only where the critic update cannot give them
        if values_source(ctx.cfg, ctx.layout) == "pass":
            phases.append(_forward_phase(ctx, stage, "critic"))
        phases.append(_update_phase(ctx, stage, "critic"))
    phases += [_update_phase(ctx, stage, "actor"), _weight_sync_phase(ctx, stage)]
    if ctx.cfg.trainer.save_freq > 0:  # saving needs every trainable state on the device at once
        phases.append(Phase("checkpoint", stage, tuple(_base(ctx, stage, "checkpoint"))))
    return phases


def _native_slots(ctx: _Ctx) -> int:
    """KV-cache slots of the native engine: rollout.max_num_seqs, or fewer when fewer rows come. A
    colocated engine decodes the distinct DP shards of its rollout-TP ranks as one batch
    (`join_requests`; first-stage ranks bring them): rollout_tp / tp shards when rollout TP is larger."""
    lay = ctx.layout
    shards = 1 if lay.split else max(1, lay.rollout_tp // lay.tp)
    return min(ctx.cfg.rollout.max_num_seqs, lay.samples_per_step_per_dp * shards)


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
    if shares_weights(ctx.cfg, lay):
        notes.append(f"the native engine reads the actor's own weights (rollout tp = tp = {lay.tp}, pp 1): no "
                     f"engine copy ({_engine_copy(ctx) / GIB:.2f} GiB saved), generation keeps the actor's "
                     f"weights on the GPU")
    elif shares_stage(ctx.cfg, lay):
        notes.append(f"the native engine reads its own pipeline stage's layers from the actor (rollout tp = tp = "
                     f"{lay.tp}, pp {lay.pp}) and holds a copy of the other stages' only; generation keeps the "
                     f"actor's weights on the GPU")
    if 1 <= kv.sequences < kv.sequences_needed:
        notes.append(f"the KV cache holds {kv.sequences} of the {kv.sequences_needed} sequences each engine "
                     f"generates per step: generation runs in waves (raise rollout.gpu_memory_utilization "
                     f"or rollout.tensor_model_parallel_size for more at once)")
    return tuple(notes)


def _context(cfg: Config, world_size: int, vocab_size: int) -> _Ctx:
    layout = derive_layout(cfg, world_size, vocab_size, allow_missing_path=True)
    arch = mem.arch_from_model_config(cfg.model, vocab_size)
    return _Ctx(cfg, arch, layout, cfg.data.max_prompt_length + cfg.data.max_response_length,
                cfg.model.params_dtype, cfg.parallel.gpu_memory_gb * GIB,
                # a LoRA run's reference is the actor itself (adapters off): no weights of its own
                (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not cfg.actor.lora.enabled,
                _reward_model_arch(cfg, arch),
                mem.SeqSplit(layout.tp if cfg.parallel.sequence_parallel_at(layout.tp) else 1, layout.cp,
                             cfg.model.use_remove_padding))


def estimate(cfg: Config, world_size: int, vocab_size: int = 0, gpus_per_node: int = 0) -> Plan:
    """The plan without the fit check (derive_layout's checks still apply)."""
    ctx = _context(cfg, world_size, vocab_size)
    layout, arch = ctx.layout, ctx.arch
    stages = sorted({0, layout.pp - 1})
    by_name = {}
    for stage in stages:  # the first stage holds the most in-flight micro batches, the last the logits
        for phase in _stage_phases(ctx, stage):
            if phase.name not in by_name or phase.total > by_name[phase.name].total:
                by_name[phase.name] = phase
    kv = _kv_cache(ctx)
    gpn = gpus_per_node or cfg.parallel.gpus_per_node
    groups = rank_groups(world_size, layout.tp, layout.pp, layout.rollout_tp, layout.ep, layout.cp)
    return Plan(layout, groups, gpn, ctx.gpu_bytes, mem.total_params(arch), arch, ctx.seq, tuple(by_name.values()),
                kv, _notes(ctx, gpn, kv))


def two_copy_peak(cfg: Config, world_size: int, vocab_size: int = 0) -> float:
    """Per-GPU peak without the hybrid engine: every role's state resident in every phase (no
    offload) plus a second inference copy held throughout (what the engine holds while generating:
    vLLM's pool, or the native engine's weights and KV cache). The yardstick of the hybrid engine."""
    off = OffloadConfig()
    flat_cfg = dataclasses.replace(
        cfg, actor=dataclasses.replace(cfg.actor, offload=off), critic=dataclasses.replace(cfg.critic, offload=off),
        ref=dataclasses.replace(cfg.ref, offload_params=False),
        reward_model=dataclasses.replace(cfg.reward_model, offload_params=False),
        rollout=dataclasses.replace(cfg.rollout, free_cache_engine=False))
    flat = estimate(flat_cfg, world_size, vocab_size)
    training = max(p.total - p.bytes("rollout/") for p in flat.phases)
    rollout = flat.phase("rollout")
    copy = 0.0  # the yardstick holds a whole second copy whatever this config shares
    if shares_weights(flat_cfg, flat.layout) or shares_stage(flat_cfg, flat.layout):
        copy = _engine_copy(_context(flat_cfg, world_size, vocab_size)) - rollout.bytes("rollout/engine_weights")
    return training + rollout.bytes("rollout/") + copy


def plan(cfg: Config, world_size: int, vocab_size: int = 0, gpus_per_node: int = 0) -> Plan:
    """Groups and memory estimate of `cfg` on `world_size` GPUs; PlanError when it cannot fit."""
    p = estimate(cfg, world_size, vocab_size, gpus_per_node)
    peak = p.peak
    if peak.total > p.gpu_memory_bytes:
        name, size = peak.biggest
        raise PlanError(
            f"layout does not fit: phase '{peak.name}' (pipeline stage {peak.stage}) needs "
            f"{peak.total / GIB:.1f} GiB per GPU but parallel.gpu_memory_gb={cfg.parallel.gpu_memory_gb:g}; "
            f"biggest consumer {name} = {size / GIB:.1f} GiB. Fix: {advice(name, peak.name, cfg, p.arch.is_moe)}")
    if p.kv_cache.sequences < 1:
        raise PlanError(
            f"the rollout KV cache ({p.kv_cache.bytes / GIB:.2f} GiB after the engine's weights) cannot hold one "
            f"sequence of {p.seq_len} tokens ({p.kv_cache.bytes_per_sequence / GIB:.2f} GiB). Fix: raise "
            f"rollout.gpu_memory_utilization or rollout.tensor_model_parallel_size, or shorten data.max_*_length")
    return p
