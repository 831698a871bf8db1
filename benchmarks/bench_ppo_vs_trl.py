"""PPO step time (GAE + critic): hybridrl's trainer vs TRL's PPOTrainer, alternating runs A B A B.

Same bench model folder and tokenizer as bench_grpo_vs_trl.py (eos unreachable: exactly 32 new
tokens), 32 prompts x 1 sample per step, one PPO epoch of one mini-batch (one AdamW step for the
policy and one for the value model), KL penalty k1 x 0.05 in the reward against a frozen reference,
GAE gamma 1 lam 0.95, clip 0.2, value clip 0.2, T=1, no grad clipping (TRL's PPO does not clip), the
same loss terms (no entropy bonus: tiny_cpu.yaml's 0.03 is set to 0; token-mean; no dual clip).
Three hybridrl sides: `bypass_mode` (algorithm.rollout_correction.bypass_mode, verl's name: the
engine's log-probs are the old ones, as TRL takes them from generate's scores) and the default
configuration (KL in the reward, so a separate old-log-prob pass) against TRL as above, and
`bypass_mode 2x2` (2 mini-batches x 2 PPO epochs: four AdamW steps per model, the values from a forward
of their own) against TRL with num_mini_batches=2, num_ppo_epochs=2. Each side's step is also reported
less its garbage collection (TRL's two `gc.collect()` per update). All timed as wall clock between
consecutive steps,
fp32, 2 threads, the digit-share reward of trivial_reward.py (TRL: as a reward model, see
ppo_trl_side.py). The value model on both sides is the policy's trunk with a fresh scalar head.
TRL 1.0.0 ships `trl.experimental.ppo` (1.16 does not): --trl-python points at that environment
(default .venv-bench-trl100/bin/python).

    python benchmarks/bench_ppo_vs_trl.py [--rounds 5] [--steps 5] [--trl-python PATH]
"""
from __future__ import annotations

import dataclasses

import trl_compare as tc

LR = 1e-5
SEQ = 4 + 32  # prompt + response tokens of every row
N = 32  # rows per step


RESP = 32  # response tokens of every row: the positions the heads are needed at
MB2X2 = 2  # mini-batches and epochs of the "2x2" sides (TRL's default num_ppo_epochs is 4; 2 x 2 keeps the run short)


def training_passes(side: str, stages: dict) -> list:
    """The passes a side ran: hybridrl's from the stages it logged (no values pass where the critic
    update's forward gives the values, at 1 epoch x 1 mini-batch; no old-log-prob pass in bypass mode)."""
    k = MB2X2 if "2x2" in side else 1  # k epochs of k mini-batches of N / k rows
    update = [tc.Pass("policy fwd+bwd", N // k, SEQ, RESP, True, True, k * k),
              tc.Pass("value fwd+bwd", N // k, SEQ, RESP, False, True, k * k)]
    fwd = {"old_log_prob": tc.Pass("old log-prob fwd", N, SEQ, RESP, True, False),
           "ref": tc.Pass("ref fwd", N, SEQ, RESP, True, False),
           "values": tc.Pass("values fwd", N, SEQ, RESP, False, False)}
    if side.startswith("TRL"):
        return [fwd["ref"], fwd["values"]] + update
    return [p for stage, p in fwd.items() if stage in stages] + update


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
           "sides": "; hybridrl three times: `bypass_mode` (the engine's log-probs are the old ones, as TRL takes "
                    "generate's scores) and `default` (KL in the reward, so a separate old-log-prob pass) against "
                    "TRL, and `bypass_mode 2x2` (2 mini-batches x 2 PPO epochs, values from a forward of their own) "
                    "against `TRL 2x2` (num_mini_batches=2, num_ppo_epochs=2)",
           "bound": " (TRL and bypass_mode take the old log-probs from generation; the default configuration "
                    "runs an old-log-prob forward; at 1 epoch x 1 mini-batch no values forward on the hybridrl side: "
                    "the critic update's own forward gives them; the 2x2 sides run a values forward on both sides "
                    "and 4 updates of 16 rows each)"})
MINI_2X2 = tuple(o for o in PPO.overrides if "ppo_mini_batch_size" not in o) + (
    f"actor.ppo_mini_batch_size={N // MB2X2}", f"critic.ppo_mini_batch_size={N // MB2X2}",
    f"actor.ppo_epochs={MB2X2}", f"critic.ppo_epochs={MB2X2}")
"""bypass_mode at 2 mini-batches x 2 epochs: the critic changes before the last mini-batch's update, so
the values come from a forward of their own (values_source "pass"), as TRL's always do."""
PPO = dataclasses.replace(PPO, rounds=5, variants=(
    ("bypass_mode", PPO.overrides), ("default", tuple(o for o in PPO.overrides if o != BYPASS)),
    ("bypass_mode 2x2", MINI_2X2, "TRL 2x2")), trl_sides=(("TRL", ()), ("TRL 2x2", (MB2X2, MB2X2))))

if __name__ == "__main__":
    tc.main(PPO, __doc__)
