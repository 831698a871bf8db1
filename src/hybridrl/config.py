"""The typed configuration tree of hybridrl.

One frozen dataclass per section, every field with a default and a one-line doc. OmegaConf is used
only here (YAML loading, dotted overrides, type checking); the rest of the code receives plain
dataclasses. Cross-section rules and derived sizes live in `hybridrl.layout`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, choices: tuple) -> None:
    _check(value in choices, f"{key}={value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class DataConfig:
    train_files: List[str] = field(default_factory=lambda: ["data/tiny_arith/train.parquet"])
    """Parquet files of training prompts in verl's layout."""
    val_files: List[str] = field(default_factory=lambda: ["data/tiny_arith/test.parquet"])
    """Parquet files of validation prompts."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages or a plain string."""
    tokenizer: str = "builtin:tiny"
    """HF tokenizer folder, a SentencePiece .model file, or builtin:tiny (the project's own)."""
    max_prompt_length: int = 32
    """Longest prompt in tokens; longer ones are filtered or truncated."""
    max_response_length: int = 16
    """Most new tokens per response."""
    train_batch_size: int = 16
    """Prompts per training step (before rollout.n)."""
    val_batch_size: int = 64
    """Prompts per validation batch."""
    filter_overlong_prompts: bool = True
    """Drop (and count) prompts longer than max_prompt_length."""
    truncation: str = "error"
    """When not filtering: left, right, or error for prompts that are too long."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded)."""
    seed: int = 1
    """Seed of the per-epoch shuffle."""
    synthetic_task: str = "arith"
    """When the train/val files are missing and this is set, generate that synthetic task there."""

    def __post_init__(self):
        _check(self.max_prompt_length > 0, "data.max_prompt_length must be > 0")
        _check(self.max_response_length > 0, "data.max_response_length must be > 0")
        _check(self.train_batch_size > 0, "data.train_batch_size must be > 0")
        _check(self.val_batch_size > 0, "data.val_batch_size must be > 0")
        _one_of("data.truncation", self.truncation, ("left", "right", "error"))


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    """HF folder with config.json (+ safetensors); empty: build from the fields below, random init."""
    architecture: str = "qwen2"
    """Family used when path is empty: qwen2 or llama."""
    hidden_size: int = 64
    """Width of the residual stream (path empty)."""
    num_layers: int = 2
    """Transformer layers (path empty)."""
    num_attention_heads: int = 4
    """Query heads (path empty)."""
    num_key_value_heads: int = 2
    """Key/value heads, GQA (path empty)."""
    intermediate_size: int = 128
    """SwiGLU hidden size (path empty)."""
    vocab_size: int = 0
    """Vocabulary size (path empty); 0 takes the tokenizer's size."""
    max_position_embeddings: int = 512
    """Longest sequence (path empty)."""
    rope_theta: float = 10000.0
    """RoPE base (path empty)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (path empty)."""
    tie_word_embeddings: bool = True
    """Share input embedding and LM head (path empty)."""
    seed: int = 1234
    """Seed of the random init when path is empty."""
    params_dtype: str = "float32"
    """float32, bfloat16 or float16 for parameters and compute."""

    def __post_init__(self):
        _one_of("model.architecture", self.architecture, ("qwen2", "llama"))
        _one_of("model.params_dtype", self.params_dtype, ("float32", "bfloat16", "float16"))
        _check(self.num_layers > 0 and self.hidden_size > 0, "model sizes must be > 0")
        _check(self.num_attention_heads % max(self.num_key_value_heads, 1) == 0,
               "model.num_attention_heads must be a multiple of model.num_key_value_heads")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP of actor, critic and reference."""
    pipeline_model_parallel_size: int = 1
    """PP of actor, critic and reference; data parallel size is derived from the world size."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states over DP (megatron-core's distributed optimizer)."""
    gpus_per_node: int = 8
    """Accelerators per node (layout planner and SLURM scripts)."""
    gpu_memory_gb: float = 80.0
    """Memory of one accelerator; the layout planner refuses plans that do not fit."""
    recompute_activations: bool = False
    """Full activation recomputation in the actor/critic backward (saves memory, costs a forward)."""

    def __post_init__(self):
        _check(self.tensor_model_parallel_size >= 1, "parallel.tensor_model_parallel_size must be >= 1")
        _check(self.pipeline_model_parallel_size >= 1, "parallel.pipeline_model_parallel_size must be >= 1")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip; 0 disables."""
    lr_warmup_steps: int = 0
    """Linear warmup steps."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine decay after warmup."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of lr for linear/cosine decay."""

    def __post_init__(self):
        _check(self.lr >= 0, "optim.lr must be >= 0")
        _check(len(self.betas) == 2, "optim.betas must have two values")
        _one_of("optim.lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))


@dataclass(frozen=True)
class OffloadConfig:
    params: bool = False
    """Move parameters to CPU while the rollout runs."""
    grads: bool = False
    """Move gradient buffers to CPU while the rollout runs."""
    optimizer: bool = False
    """Move optimizer states to CPU while the rollout runs."""


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """vanilla (dual-clip PPO on token ratios) or gspo (one clipped ratio per sequence; use clip
    ranges near 3e-4 / 4e-4 and loss_agg_mode seq-mean-token-mean, as verl's GSPO recipe)."""

    def __post_init__(self):
        _one_of("actor.policy_loss.loss_mode", self.loss_mode, POLICY_LOSS_MODES)


@dataclass(frozen=True)
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule of the policy."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (times rollout.n samples)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one DP rank."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    clip_ratio_low: float = 0.2
    """PPO clip below 1."""
    clip_ratio_high: float = 0.2
    """PPO clip above 1 (clip-higher when larger than clip_ratio_low)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1)."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number."""
    loss_scale_factor: Optional[int] = None
    """Constant divisor of seq-mean-token-sum-norm; None: data.max_response_length."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy-gradient loss (verl's actor.policy_loss.loss_mode)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    use_kl_loss: bool = False
    """Add KL(actor || ref) to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss term."""
    rollout_is_threshold: Optional[float] = None
    """Truncate importance weights actor-old/rollout at this value; None disables."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Samples per forward when recomputing log-probs."""
    use_dynamic_bsz: bool = False
    """Split by a token budget instead of a row count (ignores the *_micro_batch_size_per_gpu fields)."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one update micro-batch (rows x trimmed width, padding included)."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one old-log-prob micro-batch."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """What to move to CPU during rollout."""

    def __post_init__(self):
        _check(self.ppo_max_token_len_per_gpu > 0 and self.log_prob_max_token_len_per_gpu > 0,
               "actor.ppo_max_token_len_per_gpu and actor.log_prob_max_token_len_per_gpu must be > 0")
        _check(self.clip_ratio_c > 1.0, "actor.clip_ratio_c must be > 1")
        _check(self.ppo_epochs >= 1, "actor.ppo_epochs must be >= 1")
        _one_of("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _one_of("actor.kl_loss_type", self.kl_loss_type, KL_KINDS)
        _check(self.loss_scale_factor is None or self.loss_scale_factor > 0, "actor.loss_scale_factor must be > 0")


@dataclass(frozen=True)
class CriticConfig:
    path: str = ""
    """HF folder to initialise the critic trunk from; empty: model.path (or the same random init)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule of the value model."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (times rollout.n samples)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one DP rank."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number."""
    loss_scale_factor: Optional[int] = None
    """Constant divisor of seq-mean-token-sum-norm; None: data.max_response_length."""
    use_dynamic_bsz: Optional[bool] = None
    """Split by a token budget instead of a row count; None: as actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one update micro-batch (rows x trimmed width, padding included)."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one values micro-batch; None: ppo_max_token_len_per_gpu."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """What to move to CPU during rollout."""

    def __post_init__(self):
        _one_of("critic.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check(self.loss_scale_factor is None or self.loss_scale_factor > 0, "critic.loss_scale_factor must be > 0")
        _check(self.ppo_max_token_len_per_gpu > 0 and (self.forward_max_token_len_per_gpu or 1) > 0,
               "critic.ppo_max_token_len_per_gpu and critic.forward_max_token_len_per_gpu must be > 0")


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 8
    """Samples per forward of the frozen reference."""
    offload_params: bool = False
    """Keep the reference weights on CPU between uses."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """Split by a token budget instead of a row count; None: as actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one reference micro-batch; None: actor.ppo_max_token_len_per_gpu."""

    def __post_init__(self):
        _check((self.log_prob_max_token_len_per_gpu or 1) > 0, "ref.log_prob_max_token_len_per_gpu must be > 0")


@dataclass(frozen=True)
class ValKwargsConfig:
    n: int = 1
    """Responses per prompt during validation (mean@N, best@N, maj@N)."""
    do_sample: bool = False
    """Sample during validation; False is greedy whatever the temperature."""
    temperature: float = 0.0
    """Validation sampling temperature (with do_sample)."""
    top_p: float = 1.0
    """Validation nucleus mass (with do_sample)."""
    top_k: int = -1
    """Validation top-k, -1 disables (with do_sample)."""

    def __post_init__(self):
        _check(self.n >= 1, "rollout.val_kwargs.n must be >= 1")
        _check(self.n == 1 or (self.do_sample and self.temperature > 0),
               f"rollout.val_kwargs.n={self.n} without sampling gives {self.n} identical greedy responses; "
               "set rollout.val_kwargs.do_sample=true and rollout.val_kwargs.temperature > 0, or n=1")
        _check(self.temperature >= 0, "rollout.val_kwargs.temperature must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.val_kwargs.top_p must be in (0, 1]")


@dataclass(frozen=True)
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts: between turns the model may call tools (Hermes <tool_call> format)."""
    max_turns: int = 3
    """Most model turns per trajectory (verl's max_assistant_turns); calls in the last one are not run."""
    max_tool_response_length: int = 256
    """Characters of one tool result the model reads back; longer results are truncated."""
    max_parallel_calls: int = 1
    """Tool calls run per turn; further calls in the same turn are ignored."""
    tool_timeout_s: float = 10.0
    """A tool call running longer is abandoned and reported to the model as an error."""
    tools: List[str] = field(default_factory=lambda: ["calculator"])
    """Tools: built-in names (calculator) or 'package.module:function' entries, fn(**arguments) -> str."""

    def __post_init__(self):
        _check(self.max_turns >= 1, "rollout.multi_turn.max_turns must be >= 1")
        _check(self.max_tool_response_length >= 1, "rollout.multi_turn.max_tool_response_length must be >= 1")
        _check(self.max_parallel_calls >= 1, "rollout.multi_turn.max_parallel_calls must be >= 1")
        _check(self.tool_timeout_s > 0, "rollout.multi_turn.tool_timeout_s must be > 0")
        for entry in self.tools:
            _check(entry.isidentifier() or entry.count(":") == 1,
                   f"rollout.multi_turn.tools entry {entry!r} must be a built-in name (calculator) or "
                   "'package.module:function'")


@dataclass(frozen=True)
class RolloutConfig:
    name: str = "native"
    """Inference engine: native (megatron-core KV cache) or vllm."""
    n: int = 4
    """Responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    tensor_model_parallel_size: int = 1
    """TP of the inference engine (may differ from training TP)."""
    update_weights_bucket_mb: int = 64
    """Size of one weight bucket streamed into the engine."""
    verify_weights: str = "fingerprint"
    """Weight-sync check of what the engine stored: fingerprint (on device), exact (host hash), off."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory for weights + KV cache."""
    enforce_eager: bool = False
    """No CUDA graphs of the decode step (native and vLLM); CPU always runs eagerly."""
    max_num_seqs: int = 256
    """Sequences decoded at once: the native engine's KV-cache slots (refilled as rows stop); vLLM's max_num_seqs."""
    free_cache_engine: bool = True
    """Sleep the engine (free KV cache/weights) after each rollout."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling of validation (verl's rollout.val_kwargs)."""
    seed: int = 0
    """Sampling seed."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-calling rollouts (the agent loop)."""

    def __post_init__(self):
        _one_of("rollout.name", self.name, ("native", "vllm"))
        _check(self.n >= 1, "rollout.n must be >= 1")
        _check(self.temperature >= 0, "rollout.temperature must be >= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _check(self.update_weights_bucket_mb > 0, "rollout.update_weights_bucket_mb must be > 0")
        _check(self.max_num_seqs >= 1, "rollout.max_num_seqs must be >= 1 (KV-cache slots of the engine)")
        _one_of("rollout.verify_weights", self.verify_weights, ("fingerprint", "exact", "off"))


ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@dataclass(frozen=True)
class KLControlConfig:
    type: str = "fixed"
    """fixed or adaptive KL coefficient."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient of the reward penalty."""
    target_kl: float = 0.1
    """Adaptive controller target."""
    horizon: int = 10000
    """Adaptive controller horizon."""

    def __post_init__(self):
        _one_of("algorithm.kl_ctrl.type", self.type, ("fixed", "adaptive"))


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    bypass_mode: bool = False
    """verl's bypass mode (loss_type ppo_clip): the rollout engine's log-probs are the old log-probs,
    so no separate old-log-prob pass runs; the PPO ratio is then actor / rollout engine."""


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, generate more until the batch is full."""
    metric: str = "acc"
    """Per-response value compared within a group: acc / score (before overlong shaping), seq_reward (after),
    or a numeric key returned by the custom reward function."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before stopping with an error; <= 0: no limit."""

    def __post_init__(self):
        _check(bool(self.metric), "algorithm.filter_groups.metric must name a value, e.g. acc")


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """gae (PPO with critic), grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide group-relative advantages by the group std."""
    use_kl_in_reward: bool = False
    """Subtract coef * KL(actor || ref) from token rewards."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of the reward-penalty coefficient."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Where the old log-probs come from when the engine's may stand in for them."""

    def __post_init__(self):
        _one_of("algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        _one_of("algorithm.kl_penalty", self.kl_penalty, KL_KINDS)

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator == "gae"


@dataclass(frozen=True)
class CustomRewardConfig:
    path: str = ""
    """Python file with a user reward function; empty: the built-in registry by data_source."""
    name: str = "compute_score"
    """Name of the function in that file."""


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong shaping: penalise responses longer than data.max_response_length - len."""
    len: int = 0
    """Tokens of the buffer at the end of the response length where the penalty ramps up."""
    penalty_factor: float = 1.0
    """Penalty at the full response length (linear from 0 at the buffer start)."""

    def __post_init__(self):
        _check(not self.enable or self.len > 0, "reward.overlong_buffer.len must be > 0 when enabled")
        _check(self.penalty_factor >= 0, "reward.overlong_buffer.penalty_factor must be >= 0")


GSM8K_METHODS = ("strict", "flexible", "flexible_lenient")


@dataclass(frozen=True)
class RewardConfig:
    custom_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    """User reward function."""
    gsm8k_method: str = "strict"
    """strict ("#### " then the number) or flexible (last number), both as verl; flexible_lenient
    (last number, commas/$/final period stripped) is hybridrl's own."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong reward shaping."""

    def __post_init__(self):
        _one_of("reward.gsm8k_method", self.gsm8k_method, GSM8K_METHODS)


REWARD_COMBINE_MODES = ("replace", "add")


@dataclass(frozen=True)
class RewardModelTrainConfig:
    steps: int = 150
    """scripts/train_rm.py: optimizer steps of the Bradley-Terry training."""
    batch_size: int = 32
    """Preference pairs per optimizer step, over all DP ranks."""
    micro_batch_size_per_gpu: int = 32
    """Pairs per forward/backward on one DP rank (each pair is two sequences)."""
    num_pairs: int = 4096
    """Training pairs generated from the prompts of data.train_files."""
    num_val_pairs: int = 256
    """Held-out pairs generated from data.val_files, for the printed preference accuracy."""
    val_freq: int = 25
    """Evaluate the held-out accuracy every this many steps and at the end; 0: only at the end."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer and LR schedule of the reward model."""
    seed: int = 7
    """Seed of the pair generator and of the fresh score head."""

    def __post_init__(self):
        _check(self.steps >= 1, "reward_model.train.steps must be >= 1")
        _check(self.batch_size >= 1 and self.micro_batch_size_per_gpu >= 1,
               "reward_model.train.batch_size and .micro_batch_size_per_gpu must be >= 1")
        _check(self.num_pairs >= self.batch_size,
               "reward_model.train.num_pairs must be at least one batch (reward_model.train.batch_size)")
        _check(self.num_val_pairs >= 1, "reward_model.train.num_val_pairs must be >= 1")


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = False
    """Score responses with a reward model: a frozen megatron-core GPTModel with a scalar head."""
    path: str = ""
    """HF folder of a Qwen2/Llama *ForSequenceClassification model (score.weight); train_rm.py writes one."""
    tokenizer: str = ""
    """Tokenizer of the reward model; empty: data.tokenizer. Another one: responses are re-encoded for it."""
    micro_batch_size_per_gpu: int = 8
    """Sequences per reward-model forward on one DP rank."""
    max_length: int = 0
    """Longest re-encoded input (tokens, kept from the end); 0: data.max_prompt_length + max_response_length."""
    offload_params: bool = False
    """Keep the reward model's weights on the host except while it scores (hybrid engine)."""
    combine: str = "replace"
    """replace: the reward is the RM score; add: RM score + the rule score of the row's data_source."""
    train: RewardModelTrainConfig = field(default_factory=RewardModelTrainConfig)
    """scripts/train_rm.py settings."""

    def __post_init__(self):
        _one_of("reward_model.combine", self.combine, REWARD_COMBINE_MODES)
        _check(self.micro_batch_size_per_gpu >= 1, "reward_model.micro_batch_size_per_gpu must be >= 1")
        _check(self.max_length >= 0, "reward_model.max_length must be >= 0 (0: prompt + response length)")
        _check(not self.enable or bool(self.path),
               "reward_model.enable=true needs reward_model.path: an HF *ForSequenceClassification folder "
               "(scripts/train_rm.py --config <this config> writes one there)")


@dataclass(frozen=True)
class TrainerConfig:
    total_training_steps: int = 40
    """Training steps to run (0: total_epochs over the data)."""
    total_epochs: int = 1
    """Epochs over the data when total_training_steps is 0."""
    critic_warmup: int = 0
    """Steps that update only the critic before the actor starts learning."""
    test_freq: int = 10
    """Validate every this many steps and at the last; 0 disables, -1 only at the last step."""
    val_before_train: bool = True
    """Validate once before the first step."""
    save_freq: int = 0
    """Checkpoint every this many steps; 0 disables."""
    max_ckpt_to_keep: int = 2
    """Keep the last K checkpoints."""
    default_local_dir: str = "outputs/checkpoints"
    """Where checkpoints go."""
    resume_mode: str = "auto"
    """auto (latest in default_local_dir), disable, or a checkpoint path."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on (published when complete)."""
    export_hf_dir: str = ""
    """Write the final actor as an HF folder here; empty disables."""
    log_dir: str = "outputs/tensorboard"
    """TensorBoard event files."""
    logger: List[str] = field(default_factory=lambda: ["console", "tensorboard"])
    """Metric sinks: console and/or tensorboard."""
    project_name: str = "hybridrl"
    """Project name (folder under log_dir)."""
    experiment_name: str = "tiny_cpu"
    """Run name (folder under log_dir/project_name)."""
    seed: int = 1
    """Global seed of torch RNGs."""
    progress_bar: bool = True
    """Show a progress bar over steps (rank 0)."""
    log_freq: int = 1
    """Print a console line every this many steps (and at validations and the last step)."""

    def __post_init__(self):
        _check(self.total_training_steps >= 0, "trainer.total_training_steps must be >= 0")
        _check(self.test_freq >= -1, "trainer.test_freq must be >= 1, 0 (never) or -1 (only at the end)")
        _check(self.log_freq >= 1, "trainer.log_freq must be >= 1")
        _check(self.max_ckpt_to_keep >= 1, "trainer.max_ckpt_to_keep must be >= 1")
        for sink in self.logger:
            _one_of("trainer.logger", sink, ("console", "tensorboard"))


@dataclass(frozen=True)
class SFTConfig:
    train_files: List[str] = field(default_factory=lambda: ["data/tiny_tools_sft/train.parquet"])
    """Parquet files of chat trajectories for scripts/train_sft.py (loss on assistant tokens only)."""
    messages_key: str = "messages"
    """Column holding each trajectory: a list of {role, content} messages (user, assistant, tool)."""
    max_length: int = 256
    """Longest trajectory in tokens; longer ones are dropped (and counted)."""
    train_batch_size: int = 32
    """Trajectories per optimizer step, over all DP ranks."""
    micro_batch_size_per_gpu: int = 8
    """Trajectories per forward/backward on one DP rank."""
    total_training_steps: int = 100
    """Optimizer steps (0: total_epochs over the data)."""
    total_epochs: int = 1
    """Epochs over the data when total_training_steps is 0."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule of the SFT run."""
    output_dir: str = "outputs/sft/hf"
    """HF folder (model + tokenizer) written at the end; the RL run loads it with model.path=..."""
    shuffle: bool = True
    """Reshuffle the trajectories every epoch (seeded by data.seed)."""
    synthetic_task: str = ""
    """When the train files are missing and this is set (arith_tools), generate demonstrations there."""

    def __post_init__(self):
        _check(self.max_length > 1, "sft.max_length must be > 1")
        _check(self.train_batch_size > 0, "sft.train_batch_size must be > 0")
        _check(self.micro_batch_size_per_gpu > 0, "sft.micro_batch_size_per_gpu must be > 0")
        _check(self.total_training_steps >= 0, "sft.total_training_steps must be >= 0")
        _check(self.total_epochs >= 1, "sft.total_epochs must be >= 1")
        _check(bool(self.messages_key), "sft.messages_key must name the column of the trajectories")
        _check(bool(self.output_dir), "sft.output_dir must name the folder the model is written to")
        _one_of("sft.synthetic_task", self.synthetic_task, ("", "arith_tools"))


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
