"""GRPO step time: hybridrl's trainer vs TRL's GRPOTrainer, same model, alternating runs A B A B.

The bench Qwen2 (hidden 256, 4 layers, 4/2 heads, vocab 512; both sides load the same HF folder
and the same tokenizer, whose eos is unreachable so both generate exactly 32 tokens), 8 prompts x
4 samples x 32 new tokens per step, AdamW at the same lr, grad clip 1, one optimizer step per step,
fp32, 2 threads, the trivial reward of trivial_reward.py. Same loss terms on both sides: the clipped
PPO surrogate (clip 0.2) over advantages normalised by the group's std, averaged over all tokens of
the batch (TRL's loss_type "dapo", hybridrl's token-mean); no KL term, no entropy bonus
(tiny_cpu.yaml's entropy_coeff 0.03 is set to 0), no dual clip (TRL has none). Both timed as wall
clock between consecutive steps. hybridrl runs in this interpreter (hybridrl_side.py), TRL in
--trl-python (grpo_trl_side.py). The first step of every run is skipped.

    python benchmarks/bench_grpo_vs_trl.py [--rounds 3] [--steps 5] [--trl-python PATH] [--no-write]
"""
from __future__ import annotations

import trl_compare as tc

LR = 1e-5
SEQ = 4 + 32  # prompt + response tokens of every row


def training_passes(side: str, stages: dict) -> list:
    """The passes a side ran (hybridrl's from the stages it logged)."""
    if side == "TRL":
        return [tc.Pass("policy fwd+bwd", 32, SEQ, 32, True, True)]
    hybridrl = [tc.Pass("actor fwd+bwd", 32, SEQ, 32, True, True)]
    if "old_log_prob" in stages:  # absent when the update's own forward gives the old log-probs
        hybridrl.insert(0, tc.Pass("old log-prob fwd", 32, SEQ, 32, True, False))
    return hybridrl


SAME_LOSS = ("actor.entropy_coeff=0", "actor.loss_agg_mode=token-mean", "algorithm.norm_adv_by_std_in_grpo=true",
             "actor.use_kl_loss=false", "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.2",
             "actor.clip_ratio_c=1.0e9")
"""TRL GRPOConfig(beta=0, loss_type="dapo", scale_rewards="group", epsilon=0.2): the same terms."""


GRPO = tc.Comparison(
    name="grpo", title="GRPO step: hybridrl vs TRL GRPOTrainer", setup="8 prompts x 4 samples x 32 tokens",
    trl_version="1.16.0", trl_venv=".venv-bench", trl_script="grpo_trl_side.py",
    trl_stages={"generate_s": "generate (HF generate)", "score_s": "generate + score + advantages"},
    trl_rollout_stage="generate + score + advantages",
    stages=("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights"),
    # one optimizer step per rollout batch, micro-batches by token budget (one here: 32 x 36 tokens)
    overrides=("data.max_response_length=32", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
               "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096",
               "actor.log_prob_max_token_len_per_gpu=4096", f"actor.optim.lr={LR}", "actor.optim.clip_grad=1.0")
    + SAME_LOSS,
    lr=LR, profiled="update_actor", passes=training_passes)

if __name__ == "__main__":
    tc.main(GRPO, __doc__)
