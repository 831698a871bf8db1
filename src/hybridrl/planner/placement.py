"""Automatic role placement: the predicted step time of colocated and split layouts from per-phase costs.

`PhaseCosts` holds what each phase of a PPO step costs in single-device seconds (the time one GPU
would take at perfect efficiency), from a profile run's `timing_s/*` (`from_profile`) or from a FLOP
and bandwidth model of the config (`from_config`). `place(costs, world, gpus_per_node, staleness)`
returns the colocated layout (the hybrid engine: every device runs every phase in turn) and every split
layout (the last k ranks only generate, c ranks before them train the critic, the first world - k - c
train the actor), each group at the TP x PP that fits memory with the best efficiency, fastest first.
`render` is the table `scripts/plan_layout.py --placement auto` prints.

Time model (stated, not measured): W single-device seconds on n devices at TP t, PP p take
W / (n * eff), eff = (1 - tp_overhead)^log2(t) * m / (m + p - 1): each TP doubling loses tp_overhead
to its all-reduces (TP stays within a node), a 1F1B pipeline of m micro-batches idles (p-1)/(m+p-1);
data parallelism is free (gradient all-reduce overlapped). Generation never finishes faster than
`gen_floor_s` (one response decoded alone), and the weight sync costs `update_weights` seconds in any
layout (bandwidth-bound). Per step, with train = max(actor's reward + old log-prob + ref, critic's
values) + max(actor update, critic update) (the actor's group runs all of them in turn when c = 0):
    colocated:            (all phases + switch) on all devices + sync
    split, staleness 0:   gen(k) + train + sync
    split, staleness >= 1: max(gen(k), train) + sync   (the sync is not hidden)
A group's utilisation is its busy time over the step time. This module builds no model and no process group.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hybridrl.config import Config, ConfigError
from hybridrl.config.layout import derive_layout
from hybridrl.placement.transport import sends_shards
from hybridrl.planner import memory as mem
from hybridrl.planner.plan import GIB, RUNTIME_OVERHEAD_GIB, estimate
from hybridrl.workers.actor import old_log_prob_source
from hybridrl.workers.critic import values_source

TRAIN_PHASES = ("reward", "old_log_prob", "ref", "values", "update_critic", "update_actor")
MemoryFits = Callable[[str, int, int, int], bool]
"""fits(role, devices, tp, pp); role is "colocated", "trainer" (actor with critic), "actor", "critic" or "rollout"."""


@dataclass(frozen=True)
class Efficiency:
    tp_overhead: float = 0.1
    """Fraction of time each doubling of TP loses to its all-reduces (NVLink, within a node)."""
    micro_batches: int = 8
    """Micro-batches per pipeline flush: PP p idles (p - 1) / (m + p - 1) of the time."""

    def __call__(self, tp: int, pp: int = 1) -> float:
        m = self.micro_batches
        return (1 - self.tp_overhead) ** math.log2(tp) * m / (m + pp - 1)


@dataclass(frozen=True)
class PhaseCosts:
    """Single-device seconds per step of each phase (verl's timing names), except where noted."""
    gen: float
    reward: float = 0.0
    old_log_prob: float = 0.0
    ref: float = 0.0
    values: float = 0.0
    update_critic: float = 0.0
    update_actor: float = 0.0
    update_weights: float = 0.0
    """Seconds of one weight sync, not divided by devices (bandwidth-bound)."""
    gen_floor_s: float = 0.0
    """Seconds generation takes at least, however many engines share it (one response decoded alone)."""
    switch: float = 0.0
    """Colocated only: the hybrid engine's offload/onload around generation (single-device seconds)."""

    @property
    def training(self) -> float:
        return sum(getattr(self, p) for p in TRAIN_PHASES)

    @property
    def has_critic(self) -> bool:
        return self.values + self.update_critic > 0

    @classmethod
    def from_profile(cls, metrics: Dict[str, float], world: int, train_efficiency: float = 1.0,
                     gen_efficiency: float = 1.0, gen_floor_s: float = 0.0) -> "PhaseCosts":
        """Costs from `timing_s/<phase>` seconds measured colocated on `world` devices whose layout ran
        at the given efficiencies: work = seconds * world * efficiency. `adv` (CPU) counts as reward;
        the part of `gen` outside `generate_sequences` (the engine's window) is the hybrid switch."""
        t = lambda k: float(metrics.get(f"timing_s/{k}", 0.0))
        engine = t("generate_sequences") or t("gen")
        work = {p: t(p) * world * train_efficiency for p in TRAIN_PHASES}
        work["reward"] += t("adv") * world * train_efficiency
        return cls(gen=engine * world * gen_efficiency, update_weights=t("update_weights"), gen_floor_s=gen_floor_s,
                   switch=max(t("gen") - engine, 0.0) * world, **work)

    @classmethod
    def from_config(cls, cfg: Config, world: int, vocab_size: int = 0, train_flops: float = 400e12,
                    decode_efficiency: float = 0.5, hbm_bandwidth: float = 3.0e12,
                    sync_bandwidth: float = 25e9) -> "PhaseCosts":
        """Costs from FLOPs and bytes, over full-length sequences (prompt + response at their maxima,
        so an upper bound). Training: 2·P FLOPs per token forward, 6·P forward and backward (8·P with
        recompute), at `train_flops` per device (attention's s² term left out: ~2% at 1.5k tokens);
        P counts the parameters a token passes through (for MoE the active ones, k of E experts),
        while bytes (decode reads, the sync) count all of them.
        Prefill at training speed; each decoded token costs the larger of its compute (2·P at
        decode_efficiency · train_flops) and its HBM reads: the weights, shared by the engine's batch
        (the KV cache's sequences, at most rollout.max_num_seqs), plus its own KV context. The floor is
        one response alone (the weights it passes through read once per token, over rollout TP); the
        sync sends the weights at `sync_bandwidth` bytes/s. No hybrid switch cost (a profile measures it)."""
        layout = derive_layout(cfg, world, vocab_size, allow_missing_path=True)
        arch = mem.arch_from_model_config(cfg.model, vocab_size)
        params, e = mem.total_params(arch), mem.BYTES_PER_ELEMENT[cfg.model.params_dtype]
        active = mem.active_params(arch)
        d, samples = cfg.data, layout.samples_per_step
        forward = 2 * active * samples * (d.max_prompt_length + d.max_response_length) / train_flops
        update = forward * (4 if cfg.parallel.recompute_activations else 3)
        batch = max(1, min(cfg.rollout.max_num_seqs, estimate(cfg, world, vocab_size).kv_cache.sequences))
        context = d.max_prompt_length + d.max_response_length / 2
        kv = mem.kv_bytes_per_token(arch, 1, 1, cfg.model.params_dtype)
        per_token = max(2 * active / (train_flops * decode_efficiency),
                        (params * e / batch + context * kv) / hbm_bandwidth)
        prefill = 2 * active * samples * d.max_prompt_length / train_flops
        critic = cfg.algorithm.uses_critic
        return cls(
            gen=prefill + samples * d.max_response_length * per_token,
            reward=forward if cfg.reward_model.enable else 0.0,  # scored by a model of the actor's size
            old_log_prob=forward if old_log_prob_source(cfg, layout) == "pass" else 0.0,
            ref=forward if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward else 0.0,
            values=forward if critic and values_source(cfg, layout) == "pass" else 0.0,
            update_critic=update * cfg.critic.ppo_epochs if critic else 0.0,
            update_actor=update * cfg.actor.ppo_epochs,
            update_weights=params * e / sync_bandwidth,
            gen_floor_s=d.max_response_length * active * e / (cfg.rollout.tensor_model_parallel_size * hbm_bandwidth))


def load_profile(path: str) -> Dict[str, float]:
    """The mean of each `timing_s/*` key over a JSON object, a JSON list of step dicts, or JSON lines."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
        steps = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        steps = [json.loads(line) for line in text.splitlines() if line.strip()]
    keys = {k for s in steps for k in s if k.startswith("timing_s/")}
    if not keys:
        raise ConfigError(f"{path} holds no timing_s/* keys; give the metrics of a --profile run")
    return {k: sum(float(s.get(k, 0.0)) for s in steps) / len(steps) for k in keys}


@dataclass(frozen=True)
class Group:
    """Devices [first_rank, first_rank + devices) running one role at TP x PP."""
    role: str
    first_rank: int
    devices: int
    tp: int
    pp: int = 1


@dataclass(frozen=True)
class Candidate:
    mode: str
    """"colocated" or "split"."""
    staleness: int
    groups: Tuple[Group, ...]
    """Colocated: "colocated" (training) and "rollout" over the same devices; split: rollout, actor, critic."""
    step_s: float
    busy_s: Tuple[Tuple[str, float], ...]
    fits: bool = True

    def group(self, role: str) -> Optional[Group]:
        return next((g for g in self.groups if g.role == role), None)

    @property
    def utilisation(self) -> Dict[str, float]:
        return {role: busy / self.step_s for role, busy in self.busy_s}

    def overrides(self) -> List[str]:
        """The dotted overrides that select this layout."""
        train = self.group("colocated") or self.group("actor")
        out = [f"placement.mode={self.mode}"]
        if self.mode == "split":
            critic = self.group("critic")
            out += [f"placement.rollout_world_size={self.group('rollout').devices}",
                    f"placement.critic_world_size={critic.devices if critic else 0}"]
        out += [f"parallel.tensor_model_parallel_size={train.tp}", f"parallel.pipeline_model_parallel_size={train.pp}"]
        if self.mode == "split" and self.group("critic"):
            out += [f"critic.tensor_model_parallel_size={critic.tp}",
                    f"critic.pipeline_model_parallel_size={critic.pp}"]
        return out + ([f"async_training.staleness_threshold={self.staleness}"] if self.mode == "split" else [])


def place(costs: PhaseCosts, world: int, gpus_per_node: int, staleness: int = 0,
          memory_fits: Optional[MemoryFits] = None, *, rollout_tp: int = 1, efficiency: Efficiency = Efficiency(),
          pp_options: Sequence[int] = (1, 2, 4, 8), whole_nodes: bool = True) -> List[Candidate]:
    """Colocated and every split of `world` devices, best first (see the module doc for the model).
    Rollout takes multiples of rollout_tp (whole nodes when world > gpus_per_node and whole_nodes);
    each training group takes the fitting TP (a divisor of gpus_per_node, TP groups inside a node)
    x PP of best efficiency; a split whose group fits no TP x PP is left out, colocated never is."""
    fits = functools.lru_cache(maxsize=None)(memory_fits or (lambda role, n, tp, pp: True))

    def best(role: str, first: int, n: int, need_fit: bool = True) -> Optional[Tuple[int, int]]:
        options = [(tp, pp) for tp in range(1, gpus_per_node + 1) for pp in pp_options
                   if gpus_per_node % tp == 0 and n % (tp * pp) == 0 and first % tp == 0
                   and (not need_fit or fits(role, n, tp, pp))]
        return max(options, key=lambda o: (efficiency(*o), -o[0] * o[1]), default=None)

    out = [_colocated(costs, world, staleness, rollout_tp, efficiency, best("colocated", 0, world),
                      best("colocated", 0, world, need_fit=False), fits("rollout", world, rollout_tp, 1))]
    unit = math.lcm(rollout_tp, gpus_per_node) if whole_nodes and world > gpus_per_node else rollout_tp
    for k in range(unit, world, unit):
        if (world - k) % rollout_tp or not fits("rollout", k, rollout_tp, 1):
            continue
        rest = world - k
        for c in range(rest) if costs.has_critic else (0,):
            a = rest - c
            actor = best("trainer" if c == 0 else "actor", 0, a)
            critic = best("critic", a, c) if c else None
            if actor is None or (c and critic is None):
                continue
            groups = (Group("rollout", world - k, k, rollout_tp), Group("actor", 0, a, *actor))
            groups += (Group("critic", a, c, *critic),) if critic else ()
            out.append(_split(costs, staleness, efficiency, groups))
    return sorted(out, key=lambda cand: (not cand.fits, cand.step_s))


def _gen_time(costs: PhaseCosts, devices: int, rollout_tp: int, efficiency: Efficiency) -> float:
    return max(costs.gen / (devices * efficiency(rollout_tp)), costs.gen_floor_s)


def _colocated(costs, world, staleness, rollout_tp, efficiency, fitting, any_layout, rollout_fits) -> Candidate:
    tp, pp = fitting or any_layout
    step = ((costs.training + costs.switch) / (world * efficiency(tp, pp))
            + _gen_time(costs, world, rollout_tp, efficiency) + costs.update_weights)
    groups = (Group("colocated", 0, world, tp, pp), Group("rollout", 0, world, rollout_tp))
    return Candidate("colocated", staleness, groups, step, (("all", step),), fitting is not None and rollout_fits)


def _split(costs: PhaseCosts, staleness: int, efficiency: Efficiency, groups: Tuple[Group, ...]) -> Candidate:
    rollout, actor = groups[0], groups[1]
    critic = groups[2] if len(groups) > 2 else None
    gen = _gen_time(costs, rollout.devices, rollout.tp, efficiency)
    on_actor = actor.devices * efficiency(actor.tp, actor.pp)
    pre_a = (costs.reward + costs.old_log_prob + costs.ref) / on_actor
    upd_a = costs.update_actor / on_actor
    if critic:
        on_critic = critic.devices * efficiency(critic.tp, critic.pp)
        pre_c, upd_c = costs.values / on_critic, costs.update_critic / on_critic
        train = max(pre_a, pre_c) + max(upd_a, upd_c)
    else:
        pre_c = upd_c = 0.0
        pre_a, upd_a = pre_a + costs.values / on_actor, upd_a + costs.update_critic / on_actor
        train = pre_a + upd_a
    sync = costs.update_weights
    step = (gen + train if staleness == 0 else max(gen, train)) + sync
    busy = (("rollout", gen + sync), ("actor", pre_a + upd_a + sync)) + ((("critic", pre_c + upd_c),) if critic else ())
    return Candidate("split", staleness, groups, step, busy)


def config_memory_fits(cfg: Config, vocab_size: int = 0) -> MemoryFits:
    """`fits(role, devices, tp, pp)` from the planner's memory estimate of `cfg` at those sizes:
    colocated is plan.estimate's verdict; a training group counts only its own roles' states in its
    phases (no engine, and no critic on an actor group with a critic group of its own); a rollout
    engine needs its weights at TP, the runtime overhead, one full sequence's KV cache and the buffers its
    weights arrive in: two of each weight stream's largest bucket (one stream per training pipeline stage and
    expert-parallel rank; a bucket holds whole tensors up to the bucket size, or one larger tensor). Shard to
    shard (the native engine at the trainers' TP, EP 1: `transport.sends_shards`) a rollout rank receives only
    its TP rank's shards: one stream per stage, tensors 1/TP the size."""
    gpu = cfg.parallel.gpu_memory_gb * GIB
    arch = mem.arch_from_model_config(cfg.model, vocab_size)
    dtype, seq = cfg.model.params_dtype, cfg.data.max_prompt_length + cfg.data.max_response_length
    weights = mem.total_params(arch) * mem.BYTES_PER_ELEMENT[dtype]
    p = cfg.parallel

    def receive(tp: int) -> float:
        shards = sends_shards(cfg.rollout.name, tp, p.tensor_model_parallel_size, p.expert_model_parallel_size)
        split = tp if shards else 1
        streams = p.pipeline_model_parallel_size * (1 if shards else p.expert_model_parallel_size)
        largest = mem.largest_tensor_params(arch, split) * mem.BYTES_PER_ELEMENT[dtype] / split
        return 2 * streams * min(max(cfg.rollout.update_weights_bucket_mb * 2 ** 20, largest), weights / split)

    def fits(role: str, devices: int, tp: int, pp: int) -> bool:
        if role == "rollout":
            if arch.num_attention_heads % tp or arch.num_key_value_heads % tp:
                return False
            kv = mem.kv_bytes_per_token(arch, tp, 1, dtype) * seq
            return weights / tp + RUNTIME_OVERHEAD_GIB * GIB + kv + receive(tp) <= gpu
        rollout_tp = cfg.rollout.tensor_model_parallel_size if role == "colocated" else 1
        parallel = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        sized = dataclasses.replace(cfg, parallel=parallel,
                                    rollout=dataclasses.replace(cfg.rollout, tensor_model_parallel_size=rollout_tp))
        try:
            p = estimate(sized, devices, vocab_size)
        except ConfigError:  # heads, layers or batch do not divide at this size
            return False
        if role == "colocated":
            return p.fits
        if role == "critic":  # its own phases and states only
            phases = [ph for ph in p.phases if ph.name.startswith("critic")]
            keep = lambda name: name.startswith(("critic/", "runtime/"))
        else:  # every training phase, without the engine (and without the critic when it has a group)
            phases = [ph for ph in p.phases if ph.name != "rollout"]
            dropped = ("rollout/", "critic/") if role == "actor" else ("rollout/",)
            keep = lambda name: not name.startswith(dropped)
        return max((sum(b for n, b in ph.items if keep(n)) for ph in phases), default=0.0) <= gpu

    return fits


def _describe(g: Optional[Group], colocated: bool = False) -> str:
    if g is None:
        return "-"
    if g.role == "rollout":
        engines = g.devices // g.tp
        return f"{'all' if colocated else g.devices} tp{g.tp} ({engines} engine{'s' if engines > 1 else ''})"
    return f"{g.devices} tp{g.tp} pp{g.pp}"


def render(candidates: Sequence[Candidate], top: int = 5) -> str:
    """A table of the first `top` candidates, plus colocated when it is not among them."""
    shown = list(candidates[:top])
    shown += [c for c in candidates[top:] if c.mode == "colocated"]
    lines = [f"  {'#':>2} {'mode':<9} {'step s':>9}  {'rollout':<20} {'actor':<13} {'critic':<13} utilisation"]
    for c in shown:
        coloc = c.mode == "colocated"
        util = "all phases in turn" if coloc else " ".join(f"{r} {100 * u:.0f}%" for r, u in c.utilisation.items())
        actor = _describe(c.group("colocated") or c.group("actor"))
        critic = "with actor" if coloc or c.group("critic") is None else _describe(c.group("critic"))
        mark = "" if c.fits else "  DOES NOT FIT"
        lines.append(f"  {candidates.index(c) + 1:>2} {c.mode:<9} {c.step_s:>9.2f}  "
                     f"{_describe(c.group('rollout'), coloc):<20} {actor:<13} {critic:<13} {util}{mark}")
    return "\n".join(lines)
