"""GRPO step time: hybridrl's trainer vs TRL's GRPOTrainer, same model, alternating runs A B A B.

The bench Qwen2 (hidden 256, 4 layers, 4/2 heads, vocab 512; both sides load the same HF folder
and the same tokenizer, whose eos is unreachable so both generate exactly 32 tokens), 8 prompts x
4 samples x 32 new tokens per step, AdamW at the same lr, grad clip 1, one optimizer step per step,
fp32, 2 threads, the trivial reward of trivial_reward.py. hybridrl runs in this interpreter
(hybridrl_side.py), TRL in --trl-python (grpo_trl_side.py). The first step of every run is skipped.

    python benchmarks/bench_grpo_vs_trl.py [--rounds 3] [--steps 5] [--trl-python PATH] [--no-write]
"""
from __future__ import annotations

import os

import benchlib as bl
import trl_compare as tc

LR = 1e-5
STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights")
TRL_STAGES = {"generate_s": "generate (HF generate)", "score_s": "generate + score + advantages"}
SEQ = 4 + 32  # prompt + response tokens of every row
PROFILED = "update_actor"  # the stage whose profile the report attaches


def hybridrl_overrides() -> list:
    """One optimizer step per rollout batch, micro-batches by token budget (one here: 32 x 36 tokens)."""
    return ["data.max_response_length=32", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
            "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096",
            "actor.log_prob_max_token_len_per_gpu=4096", f"actor.optim.lr={LR}", "actor.optim.clip_grad=1.0"]


def report(runs: list, rounds: int, steps: int, trl_python: str, prof: dict) -> str:
    ratio, verdict = tc.verdict(runs)
    h, t = tc.stage_medians(runs, "hybridrl"), tc.stage_medians(runs, "trl")
    training = {"hybridrl": tc.pooled(runs, "hybridrl") - h["gen"] - h.get("update_weights", 0.0),
                "TRL": tc.pooled(runs, "trl") - t[TRL_STAGES["score_s"]]}
    passes = [("actor fwd+bwd", 32, SEQ, True, True)]
    if "old_log_prob" in h:
        passes.insert(0, ("old log-prob fwd", 32, SEQ, True, False))
    bound = tc.bound_table({"hybridrl": passes, "TRL": [("policy fwd+bwd", 32, SEQ, True, True)]}, training)
    return (f"## GRPO step: hybridrl vs TRL GRPOTrainer\n\n"
            f"Median seconds per step (steps 2..{steps} of each run; {rounds} rounds, hybridrl A then TRL B), "
            f"8 prompts x 4 samples x 32 tokens, fp32, 2 threads, AdamW lr {LR:g}.\n\n" + tc.round_table(runs)
            + f"\n\nTarget hybridrl <= 0.5x TRL: **{ratio:.2f}x** ({verdict}). Mean response lengths seen: "
            f"{tc.lengths(runs)}.\n\nStage medians (hybridrl: timing_s/*; TRL: its generation methods timed; the "
            f"rest of its step is the training forward/backward and AdamW):\n\n" + tc.stage_table(runs)
            + "\n\nTraining part (hybridrl: step - gen - update_weights; TRL: step - generate/score/advantages) "
            "against the matmul-only time of the same passes over the same tokens on this machine:\n\n" + bound
            + "\n\n" + tc.profile_text(prof, PROFILED) + f"\n\nPeer: {tc.trl_versions(trl_python)}.")


def main() -> None:
    args = tc.parse_args(__doc__, os.path.join(bl.ROOT, ".venv-bench", "bin", "python"))
    tc.check_trl_python(args.trl_python, "1.16.0")
    runs = tc.alternate("grpo", args, hybridrl_overrides(), STAGES, "grpo_trl_side.py", TRL_STAGES, LR)
    prof = tc.profile_hybridrl("grpo", args.steps, hybridrl_overrides(), PROFILED)
    tc.publish("grpo", report(runs, args.rounds, args.steps, args.trl_python, prof), args.no_write)


if __name__ == "__main__":
    main()
