"""The planner's words: the text of a plan (`render_plan`, what `scripts/plan_layout.py` and the
trainer's `--dry-run` print) and the fix for a consumer that does not fit (`advice`).

It reads a finished `Plan` and the config; it computes no memory and decides nothing.
"""
from __future__ import annotations

from hybridrl.config import Config
from hybridrl.planner.memory import GIB, active_params


def advice(consumer: str, phase: str, cfg: Config, moe: bool = False) -> str:
    """The config changes that shrink `consumer` in `phase`, most effective first (`moe`: the model
    has experts, scaled by expert parallelism first)."""
    role, kind = consumer.split("/", 1)
    idle = not phase.startswith(role) and not (phase == "weight sync" and consumer == "actor/weights")
    more_mp = "raise parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size"
    if moe:
        more_mp = "raise parallel.expert_model_parallel_size or parallel.pipeline_model_parallel_size"
    fixes = []
    if kind == "optimizer":
        if not cfg.parallel.use_distributed_optimizer:
            fixes.append("set parallel.use_distributed_optimizer=true")
        fixes += [f"set {role}.offload.optimizer=true"] if idle else []
        fixes += [more_mp, "or use more nodes (a larger DP shards the distributed optimizer further)"]
    elif kind in ("weights", "grads"):
        if role in ("ref", "reward_model"):
            fixes.append(f"set {role}.offload_params=true")
        elif idle:
            fixes.append(f"set {role}.offload.{'params' if kind == 'weights' else 'grads'}=true")
        fixes.append(more_mp)
    elif kind in ("activations", "logits", "value_head"):
        p = cfg.parallel
        if p.tensor_model_parallel_size > 1 and not p.sequence_parallel_at(p.tensor_model_parallel_size):
            fixes.append("set parallel.sequence_parallel=true")
        if kind == "activations" and not p.recompute_activations:
            fixes.append("set parallel.recompute_activations=true")
        fixes.append(f"lower {role}.ppo_micro_batch_size_per_gpu")
        # one sequence's activations split over ranks: the only fix once a micro batch is one row
        fixes.append(f"raise parallel.context_parallel_size (to {2 * p.context_parallel_size}: each sequence's "
                     "tokens split over that many ranks)")
        fixes.append(more_mp)
    elif kind == "dispatch":  # the allgather dispatcher holds the tokens of the whole EP group
        fixes += [f"lower {role}.ppo_micro_batch_size_per_gpu", "lower parallel.expert_model_parallel_size"]
    elif kind == "forward":
        micro = "micro_batch_size_per_gpu" if role == "reward_model" else "log_prob_micro_batch_size_per_gpu"
        fixes += [f"lower {role}.{micro}", more_mp]
    elif kind == "vllm_pool":
        fixes += ["lower rollout.gpu_memory_utilization",
                  "offload the idle training state during rollout (actor.offload.params/grads/optimizer=true)"]
        if not cfg.rollout.free_cache_engine:
            fixes.insert(0, "set rollout.free_cache_engine=true")
    elif kind == "engine_weights":
        fixes += ["set rollout.tensor_model_parallel_size equal to parallel.tensor_model_parallel_size at PP 1 "
                  "(the native engine then reads the actor's weights: no copy)", "raise rollout.tensor_model_parallel_size"]
        fixes += [] if cfg.rollout.free_cache_engine else ["set rollout.free_cache_engine=true"]
    elif kind == "weight_sync_buffers":
        fixes += ["lower rollout.update_weights_bucket_mb", "set rollout.tensor_model_parallel_size equal to "
                  "parallel.tensor_model_parallel_size at PP 1 (shards go straight into the engine)"]
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


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def model_size(arch, total: int) -> str:
    """"7.62B params"; for MoE the total (what memory holds) and the active share per token."""
    text = f"{_count(total)} params"
    if arch.is_moe:
        text += (f" in total, {_count(active_params(arch))} active per token "
                 f"({arch.moe_topk} of {arch.num_experts} experts)")
    return text


def render_plan(p) -> str:
    """The layout line, the process groups, every phase's consumers, the KV cache and the verdict."""
    lay = p.layout
    nodes = -(-lay.world_size // p.gpus_per_node)
    lines = [f"layout: {lay.describe()}; {nodes} node(s) x {p.gpus_per_node} GPUs; model "
             f"{model_size(p.arch, p.model_params)}, sequence {p.seq_len} tokens",
             "process groups (megatron-core order tp-cp-ep-dp-pp: rank = tp_rank + tp*cp_rank + tp*cp*dp_rank + "
             "tp*cp*dp*pp_rank):",
             _fmt_groups("TP", p.groups.tp)] + ([_fmt_groups("CP", p.groups.cp)] if lay.cp > 1 else []) + [
             _fmt_groups("PP", p.groups.pp), _fmt_groups("DP", p.groups.dp)]
    if lay.ep > 1:  # experts: dp_rank = ep_rank + ep*expert_dp_rank
        lines += [_fmt_groups("EP", p.groups.ep), _fmt_groups("expert DP", p.groups.expert_dp)]
    lines += [_fmt_groups("rollout TP", p.groups.rollout_tp),
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
