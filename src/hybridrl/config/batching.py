"""How each pass of a step splits its rows into micro-batches, resolved once from the config.

A pass uses a fixed row count (`*_micro_batch_size_per_gpu`) or, with verl's `use_dynamic_bsz`, a token
budget (`*_max_token_len_per_gpu`, per GPU: a micro-batch of whole rows holds it x the context parallel size,
as verl's Megatron engine counts it); `resolve_batching` applies verl's defaults (ref and critic follow the
actor unless set) and refuses a budget below one full row. The splitting itself is in workers.micro_batches.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config import Config, ConfigError


@dataclass(frozen=True)
class MicroBatching:
    """How one pass splits its rows: `rows` per micro-batch, or a token budget when max_tokens > 0."""
    rows: int
    max_tokens: int = 0
    """Tokens of whole rows one micro-batch may hold: the per-GPU budget x the context parallel size (each GPU
    computes 1/cp of every row), as verl's Megatron engine scales it."""
    packed: bool = False
    """Rows are packed without padding (model.use_remove_padding): a budget counts real tokens, as verl's does."""

    @property
    def dynamic(self) -> bool:
        return self.max_tokens > 0


@dataclass(frozen=True)
class RoleBatching:
    """The micro-batching of every pass of a step, resolved once from the config."""
    actor_update: MicroBatching
    actor_log_prob: MicroBatching
    ref_log_prob: MicroBatching
    critic_update: MicroBatching
    critic_values: MicroBatching


def resolve_batching(cfg: Config) -> RoleBatching:
    """verl's defaults: ref and critic follow actor.use_dynamic_bsz unless set; a ref budget
    defaults to actor.ppo_max_token_len_per_gpu, the critic's values budget to its update budget."""
    a, c, r = cfg.actor, cfg.critic, cfg.ref
    ref_dynamic = a.use_dynamic_bsz if r.log_prob_use_dynamic_bsz is None else r.log_prob_use_dynamic_bsz
    critic_dynamic = a.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
    budgets = {
        "actor.ppo_max_token_len_per_gpu": (a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu),
        "actor.log_prob_max_token_len_per_gpu": (a.use_dynamic_bsz, a.log_prob_max_token_len_per_gpu),
        "ref.log_prob_max_token_len_per_gpu": (ref_dynamic, r.log_prob_max_token_len_per_gpu
                                               or a.ppo_max_token_len_per_gpu),
        "critic.ppo_max_token_len_per_gpu": (critic_dynamic, c.ppo_max_token_len_per_gpu),
        "critic.forward_max_token_len_per_gpu": (critic_dynamic, c.forward_max_token_len_per_gpu
                                                 or c.ppo_max_token_len_per_gpu),
    }
    widest = cfg.data.max_prompt_length + cfg.data.max_response_length
    cp = cfg.parallel.context_parallel_size  # each GPU holds 1/cp of every row: a micro-batch holds budget x cp
    for key, (dynamic, budget) in budgets.items():
        if dynamic and budget * cp < widest:
            on = f" x parallel.context_parallel_size={cp}" if cp > 1 else ""
            raise ConfigError(f"{key}={budget}{on} is below one full row (data.max_prompt_length + "
                              f"data.max_response_length = {widest}); raise it to at least {-(-widest // cp)}")
    packed = cfg.model.use_remove_padding
    specs = [MicroBatching(rows, budget * cp if dynamic else 0, packed) for rows, (dynamic, budget) in zip(
        (a.ppo_micro_batch_size_per_gpu, a.log_prob_micro_batch_size_per_gpu, r.log_prob_micro_batch_size_per_gpu,
         c.ppo_micro_batch_size_per_gpu, c.ppo_micro_batch_size_per_gpu), budgets.values())]
    return RoleBatching(*specs)
