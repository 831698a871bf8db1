"""PPO step time (GAE + critic): hybridrl's trainer vs TRL's PPOTrainer, alternating runs A B A B.

Same bench model folder and tokenizer as bench_grpo_vs_trl.py (eos unreachable: exactly 32 new
tokens), 32 prompts x 1 sample per step, one PPO epoch of one mini-batch (one AdamW step for the
policy and one for the value model), KL penalty k1 x 0.05 in the reward against a frozen reference,
GAE gamma 1 lam 0.95, clip 0.2, value clip 0.2, T=1, no grad clipping (TRL's PPO does not clip),
fp32, 2 threads, the digit-share reward of trivial_reward.py (TRL: as a reward model, see
ppo_trl_side.py). The value model on both sides is the policy's trunk with a fresh scalar head.
TRL 1.0.0 ships `trl.experimental.ppo` (1.16 does not): --trl-python points at that environment
(default .venv-bench-trl100/bin/python).

    python benchmarks/bench_ppo_vs_trl.py [--rounds 3] [--steps 5] [--trl-python PATH]
"""
from __future__ import annotations

import os

import benchlib as bl
import trl_compare as tc

LR = 1e-5
STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights")
TRL_STAGES = {"generate_s": "generate (batch_generation)", "score_s": "ref + value + reward forwards",
              "train_s": "PPO epoch (policy + value fwd/bwd, AdamW) + rest"}
SEQ = 4 + 32  # prompt + response tokens of every row
PROFILED = "update_critic"  # the stage whose profile the report attaches


def hybridrl_overrides() -> list:
    budget = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096",
              "actor.log_prob_max_token_len_per_gpu=4096", "critic.ppo_max_token_len_per_gpu=4096"]
    return ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95",
            "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.kl_coef=0.05",
            "data.max_response_length=32", "data.train_batch_size=32", "rollout.n=1", "actor.ppo_mini_batch_size=32",
            "critic.ppo_mini_batch_size=32", f"actor.optim.lr={LR}", f"critic.optim.lr={LR}", "actor.optim.clip_grad=0",
            "critic.optim.clip_grad=0", "critic.cliprange_value=0.2", "actor.clip_ratio_low=0.2",
            "actor.clip_ratio_high=0.2"] + budget


def report(runs: list, rounds: int, steps: int, trl_python: str, prof: dict) -> str:
    ratio, verdict = tc.verdict(runs)
    h, t = tc.stage_medians(runs, "hybridrl"), tc.stage_medians(runs, "trl")
    training = {"hybridrl": tc.pooled(runs, "hybridrl") - h["gen"] - h.get("update_weights", 0.0),
                "TRL": tc.pooled(runs, "trl") - t[TRL_STAGES["generate_s"]]}
    n = 32
    passes = {"hybridrl": [("old log-prob fwd", n, SEQ, True, False), ("ref fwd", n, SEQ, True, False),
                           ("values fwd", n, SEQ, False, False), ("critic fwd+bwd", n, SEQ, False, True),
                           ("actor fwd+bwd", n, SEQ, True, True)],
              "TRL": [("ref fwd", n, SEQ, True, False), ("value fwd", n, SEQ, False, False),
                      ("policy fwd+bwd", n, SEQ, True, True), ("value fwd+bwd", n, SEQ, False, True)]}
    bound = tc.bound_table(passes, training)
    return (f"## PPO step: hybridrl vs TRL PPOTrainer\n\n"
            f"Median seconds per step (steps 2..{steps} of each run; {rounds} rounds, hybridrl A then TRL B), "
            f"32 prompts x 1 sample x 32 tokens, GAE + critic, KL k1 x 0.05 in the reward, one PPO epoch of one "
            f"mini-batch, fp32, 2 threads, AdamW lr {LR:g}.\n\n" + tc.round_table(runs)
            + f"\n\nTarget hybridrl <= 0.5x TRL: **{ratio:.2f}x** ({verdict}). Mean response lengths seen: "
            f"{tc.lengths(runs)} (TRL ends a response at a sampled pad token).\n\nStage medians (hybridrl: "
            f"timing_s/*; TRL: its generation and rollout-forward helpers timed, the rest is its PPO epoch):\n\n"
            + tc.stage_table(runs)
            + "\n\nTraining part (hybridrl: step - gen - update_weights; TRL: step - generate) against the "
            "matmul-only time of the same passes over the same tokens on this machine (TRL takes the old "
            "log-probs from generate's scores):\n\n" + bound
            + "\n\n" + tc.profile_text(prof, PROFILED) + f"\n\nPeer: {tc.trl_versions(trl_python)}.")


def main() -> None:
    args = tc.parse_args(__doc__, os.path.join(bl.ROOT, ".venv-bench-trl100", "bin", "python"))
    tc.check_trl_python(args.trl_python, "1.0.0")
    runs = tc.alternate("ppo", args, hybridrl_overrides(), STAGES, "ppo_trl_side.py", TRL_STAGES, LR)
    prof = tc.profile_hybridrl("ppo", args.steps, hybridrl_overrides(), PROFILED)
    tc.publish("ppo", report(runs, args.rounds, args.steps, args.trl_python, prof), args.no_write)


if __name__ == "__main__":
    main()
