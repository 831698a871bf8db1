"""Sections actor, critic and ref: optimizers, losses, micro-batching and offload of the trained roles."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from hybridrl.config.algorithm import KL_KINDS
from hybridrl.config.checks import check, one_of
from hybridrl.config.lora import LoraConfig


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW) of the weight matrices (verl's default 0.01); norms and biases are not decayed
    (megatron's rule)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global grad-norm clip; 0 disables."""
    lr_warmup_steps: int = 0
    """Linear warmup steps, from lr_warmup_init at the first update to lr after them (megatron's and verl's: the
    first update of a warmup runs at lr_warmup_init); <= 0: lr_warmup_steps_ratio of the run's steps."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a share of the run's steps (int(ratio * steps)), where lr_warmup_steps is <= 0 (verl's key)."""
    lr_warmup_init: float = 0.0
    """LR of the first warmup update (megatron's and verl's lr_warmup_init)."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine decay after warmup."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of lr for linear/cosine decay (verl's Megatron min_lr is lr * this)."""

    def __post_init__(self):
        check(self.lr >= 0, "optim.lr must be >= 0")
        check(len(self.betas) == 2, "optim.betas must have two values")
        one_of("optim.lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))
        check(0.0 <= self.lr_warmup_steps_ratio < 1.0, f"optim.lr_warmup_steps_ratio={self.lr_warmup_steps_ratio}: "
                                                      "pass a share of the run's steps in [0, 1)")
        check(self.lr_warmup_init >= 0, "optim.lr_warmup_init must be >= 0")


@dataclass(frozen=True)
class OffloadConfig:
    params: bool = False
    """Move parameters to CPU while the rollout runs."""
    grads: bool = False
    """Move gradient buffers to CPU while the rollout runs."""
    optimizer: bool = False
    """Move optimizer states to CPU while the rollout runs."""


LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "gpg", "dro", "geo_mean", "clip_cov", "kl_cov", "sapo", "dppo_tv",
                     "dppo_kl")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """vanilla (dual-clip PPO on token ratios), gspo (one clipped ratio per sequence; use clip ranges near 3e-4 /
    4e-4 and loss_agg_mode seq-mean-token-mean, as verl's GSPO recipe), cispo (clipped importance weights held
    constant, MiniMax-M1), gpg (the plain policy gradient; with adv_estimator gpg), dro (a policy gradient
    with a quadratic log-ratio penalty, dro_beta), geo_mean (GMPO: one ratio per response, the geometric mean
    of its clipped token ratios), clip_cov or kl_cov (the Entropy Mechanism paper's), sapo (a soft gate on the
    ratio instead of a clip, actor.tau_pos / tau_neg), dppo_tv or dppo_kl (DPPO: the trust region on the sampled
    token's probability, total variation or binary KL, with clip_ratio_low / high as its bounds and the importance
    weight truncated at clip_ratio_c)."""
    dro_beta: Optional[float] = None
    """DRO's penalty weight (> 0; required with loss_mode dro, as verl)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the share of a micro-batch's tokens whose gradient is dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: the covariance range (lb, ub) the dropped tokens are drawn from."""
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    """kl_cov: the share of a micro-batch's tokens (largest covariance) that get the |log-ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: the weight of that penalty."""

    def __post_init__(self):
        one_of("actor.policy_loss.loss_mode", self.loss_mode, POLICY_LOSS_MODES)
        check(self.clip_cov_ratio > 0 and self.kl_cov_ratio > 0,
              "actor.policy_loss.clip_cov_ratio and kl_cov_ratio must be > 0")
        check(self.loss_mode != "dro" or (self.dro_beta or 0) > 0,
              "actor.policy_loss.loss_mode=dro needs actor.policy_loss.dro_beta > 0 (the log-ratio penalty weight)")


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
    clip_ratio: float = 0.2
    """verl's fallback clip: what clip_ratio_low / clip_ratio_high are where set to null."""
    clip_ratio_low: Optional[float] = 0.2
    """PPO clip below 1; null: clip_ratio."""
    clip_ratio_high: Optional[float] = 0.2
    """PPO clip above 1 (clip-higher when larger than clip_ratio_low); null: clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (> 1); DPPO's truncation of the importance weight."""
    tau_pos: float = 1.0
    """SAPO: the gate's temperature on tokens with a positive advantage (> 0; verl's actor.tau_pos)."""
    tau_neg: float = 1.05
    """SAPO: the same for advantages <= 0 (verl's default is above tau_pos: negative updates fade faster)."""
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
    moe_aux_loss_coeff: float = 0.0
    """MoE load-balancing loss weight (megatron's moe_aux_loss_coeff); 0 for RL, as verl and slime default."""
    router_replay: str = "off"
    """MoE routing replay: off, or rollout (log-prob and update forwards use the experts the rollout chose)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (rank 0: off); the reference is then the base itself."""

    def __post_init__(self):
        for side in ("clip_ratio_low", "clip_ratio_high"):  # verl: `low if low is not None else clip_ratio`
            if getattr(self, side) is None:
                object.__setattr__(self, side, self.clip_ratio)
        check(self.moe_aux_loss_coeff >= 0, "actor.moe_aux_loss_coeff must be >= 0")
        one_of("actor.router_replay", self.router_replay, ("off", "rollout"))
        check(self.ppo_max_token_len_per_gpu > 0 and self.log_prob_max_token_len_per_gpu > 0,
               "actor.ppo_max_token_len_per_gpu and actor.log_prob_max_token_len_per_gpu must be > 0")
        check(self.clip_ratio_c > 1.0, "actor.clip_ratio_c must be > 1")
        check(self.tau_pos > 0 and self.tau_neg > 0, f"actor.tau_pos={self.tau_pos} and actor.tau_neg={self.tau_neg} "
                                                     "(SAPO's gate temperatures) must be > 0")
        check(self.ppo_epochs >= 1, "actor.ppo_epochs must be >= 1")
        one_of("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        one_of("actor.kl_loss_type", self.kl_loss_type, KL_KINDS)
        check(self.loss_scale_factor is None or self.loss_scale_factor > 0, "actor.loss_scale_factor must be > 0")


@dataclass(frozen=True)
class CriticConfig:
    path: str = ""
    """HF folder to initialise the critic trunk from; empty: model.path (or the same random init)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule of the value model."""
    ppo_mini_batch_size: Optional[int] = None
    """Prompts per optimizer step (times rollout.n samples); None: actor.ppo_mini_batch_size (as verl's config)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one DP rank."""
    ppo_epochs: Optional[int] = None
    """Passes over each rollout batch; None: actor.ppo_epochs (as verl's config)."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""
    loss_agg_mode: Optional[str] = None
    """How token losses become one number; None: actor.loss_agg_mode (as verl's config)."""
    loss_scale_factor: Optional[int] = None
    """Constant divisor of seq-mean-token-sum-norm; None: actor.loss_scale_factor (as verl's config), whose None
    is data.max_response_length."""
    use_dynamic_bsz: Optional[bool] = None
    """Split by a token budget instead of a row count; None: as actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one update micro-batch (rows x trimmed width, padding included)."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Token budget of one values micro-batch; None: ppo_max_token_len_per_gpu."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """What to move to CPU during rollout."""
    tensor_model_parallel_size: int = 1
    """TP of a critic on ranks of its own (placement.critic_world_size > 0); else it shares the actor's."""
    pipeline_model_parallel_size: int = 1
    """PP of a critic on ranks of its own (placement.critic_world_size > 0); else it shares the actor's."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Not supported for the critic (rank must stay 0): its value head is new and trains in full."""

    INHERITED = ("ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "loss_scale_factor")
    """What the critic takes from the actor where it leaves it unset (verl's critic.* interpolations)."""

    def inheriting(self, actor: "ActorConfig") -> "CriticConfig":
        """This config with the INHERITED settings it leaves unset taken from `actor`."""
        unset = {k: getattr(actor, k) for k in self.INHERITED if getattr(self, k) is None}
        return dataclasses.replace(self, **unset) if unset else self

    def __post_init__(self):
        check(not self.lora.enabled, f"critic.lora.rank={self.lora.rank}: LoRA is not supported for the critic (its "
              "new value head and trunk train in full); set critic.lora.rank=0, or use a critic-free estimator (grpo)")
        check(self.tensor_model_parallel_size >= 1 and self.pipeline_model_parallel_size >= 1,
              "critic.tensor_model_parallel_size and critic.pipeline_model_parallel_size must be >= 1")
        if self.loss_agg_mode is not None:
            one_of("critic.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check(self.ppo_mini_batch_size is None or self.ppo_mini_batch_size > 0, "critic.ppo_mini_batch_size must be > 0")
        check(self.ppo_epochs is None or self.ppo_epochs >= 1, "critic.ppo_epochs must be >= 1")
        check(self.loss_scale_factor is None or self.loss_scale_factor > 0, "critic.loss_scale_factor must be > 0")
        check(self.ppo_max_token_len_per_gpu > 0 and (self.forward_max_token_len_per_gpu or 1) > 0,
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
        check((self.log_prob_max_token_len_per_gpu or 1) > 0, "ref.log_prob_max_token_len_per_gpu must be > 0")
