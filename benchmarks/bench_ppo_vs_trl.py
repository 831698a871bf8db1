"""PPO step time (GAE + critic): hybridrl's trainer vs TRL's PPOTrainer, alternating runs A B A B.

Same bench model folder and tokenizer as bench_grpo_vs_trl.py (eos unreachable: exactly 32 new
tokens), 32 prompts x 1 sample per step, one PPO epoch of one mini-batch (one AdamW step for the
policy and one for the value model), KL penalty k1 x 0.05 in the reward against a frozen reference,
GAE gamma 1 lam 0.95, clip 0.2, value clip 0.2, T=1, no grad clipping (TRL's PPO does not clip), the
same loss terms (no entropy bonus: tiny_cpu.yaml's 0.03 is set to 0; token-mean; no dual clip).
Two hybridrl sides: `bypass_mode` (algorithm.rollout_correction.bypass_mode, verl's name: the
engine's log-probs are the old ones, as TRL takes them from generate's scores) and the default
configuration (KL in the reward, so a separate old-log-prob pass). Both timed as wall clock between
consecutive steps,
fp32, 2 threads, the digit-share reward of trivial_reward.py (TRL: as a reward model, see
ppo_trl_side.py). The value model on both sides is the policy's trunk with a fresh scalar head.
TRL 1.0.0 ships `trl.experimental.ppo` (1.16 does not): --trl-python points at that environment
(default .venv-bench-trl100/bin/python).

    python benchmarks/bench_ppo_vs_trl.py [--rounds 3] [--steps 5] [--trl-python PATH]
"""
from __future__ import annotations

import dataclasses

import trl_compare as tc

LR = 1e-5
SEQ = 4 + 32  # prompt + response tokens of every row
N = 32  # rows per step


def training_passes(hybridrl_stages: dict) -> dict:
    """The passes each side ran: hybridrl's from the stages it logged (no values pass where the critic
    update's forward gives the values; no old-log-prob pass in bypass mode)."""
    ran = {"old_log_prob": ("old log-prob fwd", N, SEQ, True, False), "ref": ("ref fwd", N, SEQ, True, False),
           "values": ("values fwd", N, SEQ, False, False), "update_critic": ("critic fwd+bwd", N, SEQ, False, True),
           "update_actor": ("actor fwd+bwd", N, SEQ, True, True)}
    hybridrl = [p for stage, p in ran.items() if stage in hybridrl_stages]
    return {"hybridrl": hybridrl,
            "TRL": [("ref fwd", N, SEQ, True, False), ("value fwd", N, SEQ, False, False),
                    ("policy fwd+bwd", N, SEQ, True, True), ("value fwd+bwd", N, SEQ, False, True)]}


BYPASS = "algorithm.rollout_correction.bypass_mode=true"
SAME_LOSS = ("actor.entropy_coeff=0", "actor.loss_agg_mode=token-mean", "actor.clip_ratio_c=1.0e9")

PPO = tc.Comparison(
    name="ppo", title="PPO step: hybridrl vs TRL PPOTrainer",
    setup="32 prompts x 1 sample x 32 tokens, GAE + critic, KL k1 x 0.05 in the reward, one PPO epoch of one mini-batch",
    trl_version="1.0.0", trl_venv=".venv-bench-trl100", trl_script="ppo_trl_side.py",
    trl_stages={"generate_s": "generate (batch_generation)", "score_s": "ref + value + reward forwards",
                "train_s": "PPO epoch (policy + value fwd/bwd, AdamW) + rest"},
    trl_rollout_stage="generate (batch_generation)",
    stages=("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights"),
    overrides=("algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95",
               "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.kl_coef=0.05",
               BYPASS, *SAME_LOSS,
               "data.max_response_length=32", "data.train_batch_size=32", "rollout.n=1", "actor.ppo_mini_batch_size=32",
               "critic.ppo_mini_batch_size=32", f"actor.optim.lr={LR}", f"critic.optim.lr={LR}",
               "actor.optim.clip_grad=0", "critic.optim.clip_grad=0", "critic.cliprange_value=0.2",
               "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.2", "actor.use_dynamic_bsz=true",
               "actor.ppo_max_token_len_per_gpu=4096", "actor.log_prob_max_token_len_per_gpu=4096",
               "critic.ppo_max_token_len_per_gpu=4096"),
    lr=LR, profiled="update_critic", passes=training_passes,
    notes={"lengths": " (TRL ends a response at a sampled pad token)",
           "sides": "; hybridrl twice: `bypass_mode` (the engine's log-probs are the old ones, as TRL takes "
                    "generate's scores) and `default` (KL in the reward, so a separate old-log-prob pass)",
           "bound": " (TRL and bypass_mode take the old log-probs from generation; the default configuration "
                    "runs an old-log-prob forward; no values forward on the hybridrl side: the critic update's "
                    "own forward gives them)"})
PPO = dataclasses.replace(PPO, variants=(("bypass_mode", PPO.overrides),
                                           ("default", tuple(o for o in PPO.overrides if o != BYPASS))))

if __name__ == "__main__":
    tc.main(PPO, __doc__)
