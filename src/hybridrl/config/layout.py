"""Cross-section config rules and the sizes derived from them, computed once.

`derive_layout(cfg, world_size)` is the one place that checks tp·pp·dp = world, head and layer
divisibility, and batch divisibility; it returns a read-only `Layout` instead of mutating config.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hybridrl.config import Config, ConfigError, ModelConfig
from hybridrl.config.batching import resolve_batching
from hybridrl.config.lora import check_lora_run


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    vocab_size: int
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model."""


def model_dims(model: ModelConfig, vocab_size: int = 0, allow_missing_path: bool = False) -> ModelDims:
    """Sizes of the model from its config.json (model.path) or from the config fields.

    allow_missing_path: when model.path does not exist (a placeholder such as /path/to/Qwen2-7B in a
    size config planned away from the cluster), use the config fields instead of failing."""
    if not model.path or (allow_missing_path and not os.path.exists(model.path)):
        return ModelDims(model.num_layers, model.num_attention_heads, model.num_key_value_heads,
                         model.hidden_size, model.vocab_size or vocab_size, model.num_experts if model.is_moe else 0)
    cfg_path = os.path.join(model.path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"model.path='{model.path}' has no config.json; point it at an HF model folder")
    with open(cfg_path) as f:
        hf = json.load(f)
    heads = hf["num_attention_heads"]
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    return ModelDims(hf["num_hidden_layers"], heads, _kv_heads(hf), hf["hidden_size"], hf["vocab_size"], experts)


def _kv_heads(hf: dict) -> int:
    """K/V heads as transformers reads the config: a missing field takes its class default (32 for Qwen2/Qwen3,
    8 for Mixtral), not the query head count."""
    if "num_key_value_heads" in hf:
        return hf["num_key_value_heads"]
    import transformers

    model_type = hf.get("model_type", "")
    if model_type not in transformers.CONFIG_MAPPING:
        return hf["num_attention_heads"]
    return transformers.CONFIG_MAPPING[model_type].from_dict(dict(hf)).num_key_value_heads


@dataclass(frozen=True)
class Layout:
    world_size: int
    """Every process of the job (the trainers' and, in split placement, the rollout ranks')."""
    tp: int
    pp: int
    dp: int
    rollout_tp: int
    samples_per_step: int
    """train_batch_size * rollout.n: responses per training step, over all DP ranks."""
    samples_per_step_per_dp: int
    actor_mini_batch_samples: int
    """Samples per actor optimizer step over all DP ranks."""
    critic_mini_batch_samples: int
    rollout_world_size: int = 0
    """Split placement: the last this-many ranks only generate; 0 when colocated."""
    critic_world_size: int = 0
    """Split placement: ranks that train only the critic (just before the rollout ranks); 0: with the actor."""
    critic_tp: int = 0
    critic_pp: int = 0
    critic_dp: int = 0
    """The critic's own TP / PP / DP when it has ranks of its own."""
    ep: int = 1
    """Expert parallel size of the training models (a divisor of dp)."""
    cp: int = 1
    """Context parallel size of the training models: tp * cp * pp * dp trainer ranks."""

    @property
    def split(self) -> bool:
        return self.rollout_world_size > 0

    @property
    def train_world_size(self) -> int:
        """Ranks that train the actor (tp * pp * dp of them)."""
        return self.world_size - self.rollout_world_size - self.critic_world_size

    def describe(self) -> str:
        t, c = self.train_world_size, self.critic_world_size
        critic = (f"{t}-{t + c - 1} train the critic (tp={self.critic_tp} pp={self.critic_pp} dp={self.critic_dp}), "
                  if c else "")
        where = (f"split: ranks 0-{t - 1} train, {critic}{t + c}-{self.world_size - 1} generate "
                 f"({self.rollout_world_size // self.rollout_tp} engines) " if self.split else "")
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"{where}world={self.world_size} tp={self.tp}{cp} pp={self.pp} dp={self.dp}{ep} rollout_tp={self.rollout_tp} "
                f"samples/step={self.samples_per_step} ({self.samples_per_step_per_dp} per DP rank)")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_mini_batches(role: str, mini: int, micro: int, cfg: Config, dp: int, dynamic: bool = False) -> int:
    train_bs, n = cfg.data.train_batch_size, cfg.rollout.n
    _require(train_bs % mini == 0,
             f"data.train_batch_size={train_bs} is not divisible by {role}.ppo_mini_batch_size={mini}; "
             f"make the mini batch a divisor of the train batch")
    samples = mini * n
    per_rank = samples // dp if samples % dp == 0 else 0
    # a micro batch larger than a rank's share just means one micro batch per optimizer step;
    # with a token budget (use_dynamic_bsz) the micro batch size is not used
    _require(per_rank > 0 and (dynamic or per_rank % min(micro, per_rank) == 0),
             f"{role}.ppo_mini_batch_size * rollout.n = {samples} is not divisible by "
             f"dp ({dp}) * {role}.ppo_micro_batch_size_per_gpu ({micro}); change the micro batch or the mini batch")
    return samples


def model_parallel_sizes(cfg: Config, world_size: int, dims: ModelDims) -> tuple[int, int, int]:
    """(tp, pp, dp) of the training models, after checking them against the world and the model."""
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    cp = cfg.parallel.context_parallel_size
    _require(world_size % (tp * pp * cp) == 0,
             f"world size {world_size} is not divisible by tp ({tp}) * cp ({cp}) * pp ({pp}); launch a multiple of "
             f"{tp * pp * cp} processes or change parallel.*_model_parallel_size / parallel.context_parallel_size")
    _require(dims.num_attention_heads % tp == 0,
             f"num_attention_heads={dims.num_attention_heads} is not divisible by "
             f"parallel.tensor_model_parallel_size={tp}; pick a TP that divides the heads")
    _require(dims.num_key_value_heads % tp == 0,
             f"num_key_value_heads (query groups)={dims.num_key_value_heads} is not divisible by "
             f"parallel.tensor_model_parallel_size={tp}; pick a TP that divides the KV heads")
    _require(dims.num_layers % pp == 0,
             f"num_layers={dims.num_layers} is not divisible by parallel.pipeline_model_parallel_size={pp}; "
             f"pick a PP that divides the layers")
    return tp, pp, world_size // (tp * pp * cp)


def check_long_sequences(cfg: Config) -> None:
    """Context parallelism runs colocated (actor, critic and engine on the same ranks), on rows long enough to
    cut in 2·CP chunks."""
    cp, p = cfg.parallel.context_parallel_size, cfg.placement
    if cp == 1:
        return
    _require(p.mode == "colocated",
             f"parallel.context_parallel_size={cp} with placement.mode=split is not supported (the weight and row "
             "streams address trainers by TP/PP/DP); use placement.mode=colocated or context_parallel_size=1")
    _require(cfg.data.max_prompt_length + cfg.data.max_response_length >= 2 * cp,
             f"parallel.context_parallel_size={cp} cuts each sequence into {2 * cp} chunks; sequences of "
             f"{cfg.data.max_prompt_length + cfg.data.max_response_length} tokens at most are too short for it")


def check_engine_dtype(cfg: Config) -> None:
    """A verified handoff into vLLM compares the bits the trainer sent with what the engine stored: both in
    one dtype (the native engine always runs in model.params_dtype)."""
    r, dtype = cfg.rollout, cfg.model.params_dtype
    _require(r.name != "vllm" or r.verify_weights == "off" or r.dtype == dtype,
             f"the trainer sends {dtype} weights (model.params_dtype) to a vLLM engine holding {r.dtype} "
             f"(rollout.dtype), but the verified handoff compares their bits; set rollout.dtype={dtype} or "
             f"model.params_dtype={r.dtype}, or rollout.verify_weights=off (vLLM then casts them)")


def expert_parallel_size(cfg: Config, dims: ModelDims, tp: int, dp: int) -> int:
    """EP of the training models, after checking it against the model and the layout."""
    ep = cfg.parallel.expert_model_parallel_size
    _require(ep == 1 or dims.num_experts, f"parallel.expert_model_parallel_size={ep} needs an MoE model "
                                          "(model.architecture qwen3_moe or mixtral, or such a model.path); set it to 1")
    _require(not dims.num_experts or dims.num_experts % ep == 0,
             f"num_experts={dims.num_experts} is not divisible by parallel.expert_model_parallel_size={ep}")
    _require(dp % ep == 0, f"parallel.expert_model_parallel_size={ep} must divide the data-parallel size dp={dp} "
                           "(experts are split over data-parallel ranks); launch more processes or lower it")
    _require(not dims.num_experts or cfg.parallel.sequence_parallel_at(tp) or tp == 1,
             f"MoE training at parallel.tensor_model_parallel_size={tp} needs sequence parallelism (megatron's rule); "
             "set parallel.sequence_parallel=true (or leave it null)")
    return ep


def check_router_replay(cfg: Config, dims: ModelDims) -> None:
    """actor.router_replay=rollout needs an MoE model and an engine that records its routes."""
    if cfg.actor.router_replay == "off":
        return
    _require(dims.num_experts > 0, "actor.router_replay=rollout replays expert choices, but the model is dense; "
                                   "set actor.router_replay=off")
    _require(cfg.rollout.name == "native", "actor.router_replay=rollout needs the routes the native engine records; "
                                           "set rollout.name=native or actor.router_replay=off")
    _require(not cfg.parallel.recompute_activations,
             "actor.router_replay=rollout with parallel.recompute_activations=true would recompute each layer with "
             "another micro-batch's routes; set one of them off")
    _require(not cfg.rollout.multi_turn.enable, "actor.router_replay=rollout does not record routes across the turns "
                                                "of rollout.multi_turn; set one of them off")


def split_ranks(cfg: Config, world_size: int) -> int:
    """Ranks that only generate (0 when colocated), after checking the placement against the world."""
    p, a = cfg.placement, cfg.async_training
    if p.mode == "colocated":
        _require(a.staleness_threshold == 0 and a.stream_prompts == 0 and not a.partial_rollout,
                 "async_training.* needs generation on ranks of its own: set placement.mode=split and "
                 "placement.rollout_world_size=k (colocated ranks cannot generate while they train)")
        return 0
    k, rtp = p.rollout_world_size, cfg.rollout.tensor_model_parallel_size
    _require(world_size > 1, "placement.mode=split needs at least 2 processes (one trains, one generates); "
                             "launch with torchrun --nproc_per_node=N, or use placement.mode=colocated")
    _require(k < world_size, f"placement.rollout_world_size={k} leaves no rank to train in a world of {world_size}; "
                             f"choose k <= {world_size - 1}")
    _require(k % rtp == 0, f"placement.rollout_world_size={k} is not a multiple of rollout.tensor_model_parallel_size="
                           f"{rtp}; each rollout TP group is one engine: choose k as a multiple of {rtp}")
    _require(k + p.critic_world_size < world_size,
             f"placement.rollout_world_size={k} + placement.critic_world_size={p.critic_world_size} leave no rank to "
             f"train the actor in a world of {world_size}; make them smaller")
    _require(p.critic_world_size == 0 or cfg.algorithm.uses_critic,
             f"placement.critic_world_size={p.critic_world_size} but algorithm.adv_estimator="
             f"{cfg.algorithm.adv_estimator} trains no critic; set it to 0 or use adv_estimator=gae")
    _require(cfg.rollout.name == "native",
             "placement.mode=split streams weights into the native engine; set rollout.name=native (vLLM runs "
             "colocated)")
    _require(not a.partial_rollout or a.staleness_threshold == 1,
             "async_training.partial_rollout=true loads new weights into generations in flight, which only "
             "async_training.staleness_threshold=1 has; set it to 1, or partial_rollout=false")
    _require(not a.partial_rollout or k == rtp,
             f"async_training.partial_rollout=true pauses one engine between decode steps; with "
             f"placement.rollout_world_size={k} there are {k // rtp} engines: set it to "
             f"rollout.tensor_model_parallel_size ({rtp}), or partial_rollout=false")
    _require(not a.partial_rollout or not cfg.rollout.multi_turn.enable,
             "async_training.partial_rollout=true is not available with rollout.multi_turn (a trajectory spans "
             "several generate calls); set one of them to false")
    _require(not (a.staleness_threshold > 0 and cfg.algorithm.rollout_correction.bypass_mode),
             "algorithm.rollout_correction.bypass_mode takes the engine's log-probs as the old ones, but with "
             "async_training.staleness_threshold > 0 they come from weights one version older than the policy "
             "being trained; set bypass_mode=false (the trainer computes them; algorithm.rollout_correction."
             "rollout_is, token by default here, corrects the mismatch)")
    _require(not (a.staleness_threshold and cfg.algorithm.filter_groups.enable),
             "algorithm.filter_groups generates more batches on demand, which async_training.staleness_threshold=1 "
             "cannot prefetch; set staleness_threshold=0 or disable filter_groups")
    _require(not (a.stream_prompts and (cfg.algorithm.filter_groups.enable or cfg.algorithm.adv_estimator == "remax")),
             "async_training.stream_prompts > 0 scores each chunk as it arrives, but algorithm.filter_groups and "
             "adv_estimator=remax generate more for the whole batch; set async_training.stream_prompts=0")
    _require(not (a.stream_prompts and cfg.trainer.balance_batch is True),
             "trainer.balance_batch moves whole prompt groups between DP ranks before the passes, but with "
             "async_training.stream_prompts > 0 each chunk's passes run as it arrives; set one of them off")
    return k


def check_streaming(cfg: Config, dp: int, ep: int) -> None:
    """A streamed step passes each chunk forward as it arrives, and a DP rank receives the chunks of its own
    prompts only (their number and timing differ by rank), so no per-chunk work may be collective over DP."""
    if not cfg.async_training.stream_prompts or dp == 1:
        return
    for on, what in ((cfg.placement.critic_world_size > 0, "a critic of its own (placement.critic_world_size > 0) "
                                                           "gathers each chunk's columns over the trainers' DP ranks"),
                     (ep > 1, "parallel.expert_model_parallel_size > 1 forwards each chunk in lockstep with "
                              "expert-parallel peers of other DP ranks")):
        _require(not on, f"async_training.stream_prompts > 0 at trainer dp={dp}: {what}, but the DP ranks hold "
                         "different chunks (a hang); set async_training.stream_prompts=0, or train at dp=1")


def critic_sizes(cfg: Config, dims: ModelDims) -> tuple[int, int, int]:
    """(tp, pp, dp) of a critic on placement.critic_world_size ranks of its own; zeros without one."""
    c = cfg.placement.critic_world_size
    if not c:
        return 0, 0, 0
    tp, pp = cfg.critic.tensor_model_parallel_size, cfg.critic.pipeline_model_parallel_size
    _require(c % (tp * pp) == 0, f"placement.critic_world_size={c} is not divisible by critic.tensor_model_parallel_size "
                                 f"({tp}) * critic.pipeline_model_parallel_size ({pp}); make it a multiple of {tp * pp}")
    _require(dims.num_attention_heads % tp == 0 and dims.num_key_value_heads % tp == 0 and dims.num_layers % pp == 0,
             f"critic.tensor_model_parallel_size={tp} / pipeline_model_parallel_size={pp} must divide the heads "
             f"({dims.num_attention_heads}/{dims.num_key_value_heads}) and layers ({dims.num_layers})")
    return tp, pp, c // (tp * pp)


def derive_layout(cfg: Config, world_size: int, vocab_size: int = 0, allow_missing_path: bool = False) -> Layout:
    dims = model_dims(cfg.model, vocab_size, allow_missing_path)
    k = split_ranks(cfg, world_size)
    ctp, cpp, cdp = critic_sizes(cfg, dims)
    tp, pp, dp = model_parallel_sizes(cfg, world_size - k - cfg.placement.critic_world_size, dims)
    ep = expert_parallel_size(cfg, dims, tp, dp)
    check_router_replay(cfg, dims)
    check_long_sequences(cfg)
    check_lora_run(cfg, dims.num_experts > 0)
    check_engine_dtype(cfg)
    check_streaming(cfg, dp, ep)
    _require(ep == 1 or not cfg.placement.critic_world_size,
             "parallel.expert_model_parallel_size > 1 with placement.critic_world_size > 0 is not supported; "
             "train the critic with the actor (critic_world_size=0)")
    rtp = cfg.rollout.tensor_model_parallel_size
    engine_world = k or world_size
    _require(engine_world % rtp == 0 and dims.num_key_value_heads % rtp == 0 and dims.num_attention_heads % rtp == 0,
             f"rollout.tensor_model_parallel_size={rtp} must divide the world size ({engine_world}) "
             f"and the attention/KV heads ({dims.num_attention_heads}/{dims.num_key_value_heads})")
    buffer = cfg.reward.overlong_buffer
    _require(not buffer.enable or buffer.len <= cfg.data.max_response_length,
             f"reward.overlong_buffer.len={buffer.len} is longer than data.max_response_length="
             f"{cfg.data.max_response_length}; make the buffer a part of the response length")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    _require(samples % dp == 0,
             f"data.train_batch_size * rollout.n = {samples} is not divisible by dp={dp}; "
             f"make the batch a multiple of the data-parallel size")
    batching = resolve_batching(cfg)  # also checks the token budgets
    _require(ep == 1 or not any(b.dynamic for b in vars(batching).values()),
             "use_dynamic_bsz packs each rank's rows into its own number of micro-batches, but expert-parallel ranks "
             "must forward in lockstep; with parallel.expert_model_parallel_size > 1 set actor/critic/ref "
             "use_dynamic_bsz=false")
    actor_mb = _check_mini_batches("actor", cfg.actor.ppo_mini_batch_size,
                                   cfg.actor.ppo_micro_batch_size_per_gpu, cfg, dp, batching.actor_update.dynamic)
    critic_mb = actor_mb
    if cfg.algorithm.uses_critic:
        critic_mb = _check_mini_batches("critic", cfg.critic.ppo_mini_batch_size,
                                        cfg.critic.ppo_micro_batch_size_per_gpu, cfg, cdp or dp,
                                        batching.critic_update.dynamic)
    _require(not cdp or samples % cdp == 0, f"data.train_batch_size * rollout.n = {samples} is not divisible by the "
                                            f"critic's dp={cdp}; change placement.critic_world_size or the batch")
    return Layout(world_size, tp, pp, dp, rtp, samples, samples // dp, actor_mb, critic_mb, k,
                  cfg.placement.critic_world_size, ctp, cpp, cdp, ep, cfg.parallel.context_parallel_size)
