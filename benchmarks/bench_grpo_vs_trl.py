"""GRPO step time: hybridrl's trainer vs TRL's GRPOTrainer, same model, alternating runs A B A B.

The bench Qwen2 (hidden 256, 4 layers, 4/2 heads, vocab 512; both sides load the same HF folder
and the same tokenizer, whose eos is unreachable so both generate exactly 32 tokens), 8 prompts x
4 samples x 32 new tokens per step, AdamW at the same lr, grad clip 1, one optimizer step per step,
fp32, 2 threads, the trivial reward of trivial_reward.py. hybridrl runs in this interpreter
(hybridrl_side.py), TRL in --trl-python (grpo_trl_side.py). The first step of every run is skipped.

    python benchmarks/bench_grpo_vs_trl.py [--rounds 3] [--steps 5] [--trl-python PATH] [--no-write]
"""
from __future__ import annotations

import trl_compare as tc

LR = 1e-5
SEQ = 4 + 32  # prompt + response tokens of every row


def training_passes(hybridrl_stages: dict) -> dict:
    hybridrl = [("actor fwd+bwd", 32, SEQ, True, True)]
    if "old_log_prob" in hybridrl_stages:  # absent when the update's own forward gives the old log-probs
        hybridrl.insert(0, ("old log-prob fwd", 32, SEQ, True, False))
    return {"hybridrl": hybridrl, "TRL": [("policy fwd+bwd", 32, SEQ, True, True)]}


GRPO = tc.Comparison(
    name="grpo", title="GRPO step: hybridrl vs TRL GRPOTrainer", setup="8 prompts x 4 samples x 32 tokens",
    trl_version="1.16.0", trl_venv=".venv-bench", trl_script="grpo_trl_side.py",
    trl_stages={"generate_s": "generate (HF generate)", "score_s": "generate + score + advantages"},
    trl_rollout_stage="generate + score + advantages",
    stages=("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights"),
    # one optimizer step per rollout batch, micro-batches by token budget (one here: 32 x 36 tokens)
    overrides=("data.max_response_length=32", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
               "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096",
               "actor.log_prob_max_token_len_per_gpu=4096", f"actor.optim.lr={LR}", "actor.optim.clip_grad=1.0"),
    lr=LR, profiled="update_actor", passes=training_passes)

if __name__ == "__main__":
    tc.main(GRPO, __doc__)
