"""TRL side of bench_ppo_vs_trl.py (TRL 1.0's `trl.experimental.ppo.PPOTrainer`), timed per step.

    .venv-bench-trl100/bin/python benchmarks/ppo_trl_side.py MODEL_DIR TOKENIZER_DIR PROMPTS_JSON OUT_DIR STEPS LR \
        [MINI_BATCHES EPOCHS]

Prints one JSON line last: step_s (also as wall_s: from on_train_begin or one on_step_end to the
next, all of the loop), completion_len, and per step generate_s (`batch_generation`: HF generate),
score_s (the no-grad forwards of the rollout phase: reference, value model, reward model), gc_s
(garbage collection, `gc.callbacks`: TRL's two `gc.collect()` per update and any automatic one) and
train_s (the rest: the PPO epochs, policy and value forward/backward, AdamW, loader and logging). Settings mirror the hybridrl
side: 32 prompts x 1 sample x 32 new tokens, MINI_BATCHES mini-batches x EPOCHS PPO epochs (default 1 x 1: one AdamW step), KL
penalty k1 x 0.05 in the reward, GAE gamma 1 lam 0.95, clip 0.2, value clip 0.2, T=1, fp32, 2 threads.
TRL's PPO needs a reward *model*: `DigitShareRewardModel` scores the share of digit characters in
the decoded response, the trivial reward the hybridrl side uses (checked equal on the first batch).
"""
import json
import sys
import time

import torch

torch.set_num_threads(2)
PROMPT_LEN = 4  # every "a+b=" prompt of the single-digit arith task is 4 tokens


class _Backbone(torch.nn.Module):
    def __init__(self, digits: torch.Tensor, chars: torch.Tensor):
        super().__init__()
        self.register_buffer("table", torch.stack([digits, chars], -1).float())

    def forward(self, input_ids, attention_mask, **kwargs):
        per_token = self.table[input_ids] * attention_mask[..., None]
        per_token[:, :PROMPT_LEN] = 0  # count the response only
        return type("Out", (), {"hidden_states": (per_token.cumsum(1),)})()


class DigitShareRewardModel(torch.nn.Module):
    """get_reward() reads model.score(backbone(...).hidden_states[-1]) at the last response token:
    hidden = running (digit characters, characters) of the decoded response, score = their ratio."""
    base_model_prefix = "backbone"

    def __init__(self, tokenizer, vocab: int):
        super().__init__()
        text = [tokenizer.decode([i]) for i in range(vocab)]
        self.backbone = _Backbone(torch.tensor([sum(c.isdigit() for c in s) for s in text]),
                                  torch.tensor([len(s) for s in text]))

    def score(self, hidden):
        return (hidden[..., :1] / hidden[..., 1:].clamp(min=1.0))


def _timers(module, parts):
    """Wrap the trainer module's generation and rollout-forward helpers to time them."""
    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if key != "forward" or not torch.is_grad_enabled():  # training forwards are counted as train
                    parts[key if key != "forward" else "get_reward"][-1] += time.perf_counter() - start
        return wrapper
    module.batch_generation = timed(module.batch_generation, "batch_generation")
    module.get_reward = timed(module.get_reward, "get_reward")
    module.forward = timed(module.forward, "forward")


def main(model_dir, tokenizer_dir, prompts_json, out_dir, steps, lr, mini_batches=1, epochs=1):
    import datasets
    import transformers
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    from gc_timer import time_gc
    from trivial_reward import digit_share

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, padding_side="left")
    prompts = json.load(open(prompts_json))
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert all(len(x) == PROMPT_LEN for x in ids), "the reward model assumes 4-token prompts"
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    value = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    reward = DigitShareRewardModel(tokenizer, policy.config.vocab_size)
    n = 32  # rows per rollout batch (TRL 1.0: per_device_train_batch_size; a mini-batch is n / num_mini_batches)
    args = PPOConfig(
        output_dir=out_dir, per_device_train_batch_size=n, gradient_accumulation_steps=1, num_mini_batches=int(mini_batches),
        num_ppo_epochs=int(epochs), local_rollout_forward_batch_size=n, total_episodes=n * int(steps), response_length=32,
        learning_rate=float(lr), lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, temperature=1.0,
        kl_coef=0.05, kl_estimator="k1", cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95,
        whiten_rewards=False, missing_eos_penalty=None, stop_token=None, num_sample_generations=0, bf16=False,
        fp16=False, use_cpu=True, gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
        seed=1, dataloader_num_workers=0, disable_tqdm=True)
    parts = {"batch_generation": [], "get_reward": [], "gc": []}
    _timers(module, parts)
    time_gc(parts["gc"])
    marks, lengths = [], []

    class StepTimer(transformers.TrainerCallback):
        def on_train_begin(self, *a, **kw):
            marks.append(time.perf_counter())
            for v in parts.values():
                v.append(0.0)

        def on_step_end(self, *a, **kw):
            marks.append(time.perf_counter())
            for v in parts.values():
                v.append(0.0)

    _check_reward(reward, tokenizer, digit_share)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=datasets.Dataset.from_dict({"input_ids": ids}),
                         callbacks=[StepTimer()])
    _record_lengths(module, lengths)
    trainer.train()
    step_s = [b - a for a, b in zip(marks, marks[1:])]
    gen, score, gc_s = (parts[k][:len(step_s)] for k in ("batch_generation", "get_reward", "gc"))
    print(json.dumps({"step_s": step_s, "wall_s": step_s, "gc_s": gc_s, "completion_len": lengths[:len(step_s)],
                      "generate_s": gen, "score_s": score,
                      "train_s": [s - g - r - c for s, g, r, c in zip(step_s, gen, score, gc_s)]}))


def _check_reward(reward, tokenizer, digit_share):
    """The reward model gives digit_share of the decoded response (same as the hybridrl side)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, reward.backbone.table.shape[0], (4, PROMPT_LEN + 32), generator=g)
    hidden = reward.backbone(ids, torch.ones_like(ids)).hidden_states[-1]
    got = reward.score(hidden)[:, -1, 0]
    want = torch.tensor([digit_share(tokenizer.decode(row[PROMPT_LEN:].tolist())) for row in ids])
    assert torch.allclose(got, want), (got, want)


def _record_lengths(module, sink):
    """Mean response length per step, as TRL counts it (up to the first pad token)."""
    first_true = module.first_true_indices

    def recording(bools):
        out = first_true(bools)
        if bools.dim() == 2 and bools.shape[1] == 32:
            sink.append(out.float().mean().item())
        return out
    module.first_true_indices = recording


if __name__ == "__main__":
    main(*sys.argv[1:])
