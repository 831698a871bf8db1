"""PPO step time (GAE + critic): hybridrl's trainer vs TRL's PPOTrainer, alternating runs A B A B.

Same bench model folder and tokenizer as bench_grpo_vs_trl.py (eos unreachable: exactly 32 new
tokens), 32 prompts x 1 sample per step, one PPO epoch of one mini-batch (one AdamW step for the
policy and one for the value model), KL penalty k1 x 0.05 in the reward against a frozen reference,
GAE gamma 1 lam 0.95, old log-probs from generation on both sides (TRL: generate's scores;
hybridrl: algorithm.rollout_correction.bypass_mode, verl's name for it), clip 0.2, value clip 0.2,
T=1, no grad clipping (TRL's PPO does not clip),
fp32, 2 threads, the digit-share reward of trivial_reward.py (TRL: as a reward model, see
ppo_trl_side.py). The value model on both sides is the policy's trunk with a fresh scalar head.
TRL 1.0.0 ships `trl.experimental.ppo` (1.16 does not): --trl-python points at that environment
(default .venv-bench-trl100/bin/python).

    python benchmarks/bench_ppo_vs_trl.py [--rounds 3] [--steps 5] [--trl-python PATH]
"""
from __future__ import annotations

import trl_compare as tc

LR = 1e-5
SEQ = 4 + 32  # prompt + response tokens of every row
N = 32  # rows per step


def training_passes(hybridrl_stages: dict) -> dict:
    hybridrl = [("ref fwd", N, SEQ, True, False), ("values fwd", N, SEQ, False, False),
                ("critic fwd+bwd", N, SEQ, False, True), ("actor fwd+bwd", N, SEQ, True, True)]
    if "old_log_prob" in hybridrl_stages:  # absent in bypass mode: the engine's log-probs are the old ones
        hybridrl.insert(0, ("old log-prob fwd", N, SEQ, True, False))
    return {"hybridrl": hybridrl,
            "TRL": [("ref fwd", N, SEQ, True, False), ("value fwd", N, SEQ, False, False),
                    ("policy fwd+bwd", N, SEQ, True, True), ("value fwd+bwd", N, SEQ, False, True)]}


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
               "algorithm.rollout_correction.bypass_mode=true",
               "data.max_response_length=32", "data.train_batch_size=32", "rollout.n=1", "actor.ppo_mini_batch_size=32",
               "critic.ppo_mini_batch_size=32", f"actor.optim.lr={LR}", f"critic.optim.lr={LR}",
               "actor.optim.clip_grad=0", "critic.optim.clip_grad=0", "critic.cliprange_value=0.2",
               "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.2", "actor.use_dynamic_bsz=true",
               "actor.ppo_max_token_len_per_gpu=4096", "actor.log_prob_max_token_len_per_gpu=4096",
               "critic.ppo_max_token_len_per_gpu=4096"),
    lr=LR, profiled="update_critic", passes=training_passes,
    notes={"lengths": " (TRL ends a response at a sampled pad token)",
           "bound": " (both sides take the old log-probs from generation: TRL from generate's scores, hybridrl "
                    "in bypass mode from the engine, so neither runs an old-log-prob pass)"})

if __name__ == "__main__":
    tc.main(PPO, __doc__)
