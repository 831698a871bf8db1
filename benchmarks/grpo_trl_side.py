"""TRL side of bench_grpo_vs_trl.py (run in .venv-bench): GRPOTrainer steps, timed per step.

    .venv-bench/bin/python benchmarks/grpo_trl_side.py MODEL_DIR TOKENIZER_DIR PROMPTS_JSON OUT_DIR STEPS LR

Prints one JSON line {"step_s": [...], "wall_s": [...], "gc_s": [...], "completion_len": [...],
"generate_s": [...], "score_s": [...]} last: step_s runs from on_step_begin to on_step_end, wall_s
from one step's end to the next (the first from on_train_begin), so it holds the whole loop (the
window the benchmark compares); gc_s is the garbage collection in that window (`gc.callbacks`);
generate_s times `_generate_single_turn` (HF generate), score_s all of
`_generate_and_score_completions` (generation, rewards, advantages); the rest of a step is training. Settings mirror the hybridrl side: 8 prompts x
4 samples x 32 new tokens per step, one AdamW step per generation (on-policy, so TRL skips the
old-log-prob forward), fp32, no gradient checkpointing, no KL (beta 0), T=1.
"""
import json
import sys
import time

import torch

torch.set_num_threads(2)


def main(model_dir, tokenizer_dir, prompts_json, out_dir, steps, lr):
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from gc_timer import time_gc
    from trivial_reward import trl_reward

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.step_s, self.lengths, self._start, self.marks = [], [], None, []

        def on_train_begin(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())
            gc_s.append(0.0)

        def on_step_begin(self, args, state, control, **kw):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self._start)
            self.marks.append(time.perf_counter())
            gc_s.append(0.0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    gc_s = []
    time_gc(gc_s)
    prompts = json.load(open(prompts_json))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    args = GRPOConfig(
        output_dir=out_dir, max_steps=int(steps), per_device_train_batch_size=32, num_generations=4,
        gradient_accumulation_steps=1, max_completion_length=32, learning_rate=float(lr),
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=False,
        fp16=False, use_cpu=True, gradient_checkpointing=False, logging_steps=1, report_to="none",
        save_strategy="no", beta=0.0, temperature=1.0, top_k=0, top_p=1.0, loss_type="dapo", seed=1,
        dataloader_num_workers=0, disable_tqdm=True)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=args, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), callbacks=[timer])
    parts = {"generate_s": [], "score_s": []}
    for attr, key in (("_generate_single_turn", "generate_s"), ("_generate_and_score_completions", "score_s")):
        setattr(trainer, attr, _timed(getattr(trainer, attr), parts[key]))
    trainer.train()
    wall_s = [b - a for a, b in zip(timer.marks, timer.marks[1:])]  # step end to step end: all of the loop
    print(json.dumps({"step_s": timer.step_s, "wall_s": wall_s, "gc_s": gc_s[:len(wall_s)],
                      "completion_len": timer.lengths, **parts}))


def _timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)
    return wrapper


if __name__ == "__main__":
    main(*sys.argv[1:])
