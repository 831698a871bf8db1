"""GRPO step time: hybridrl's trainer vs TRL's GRPOTrainer, same model, alternating runs A B A B.

The bench Qwen2 (hidden 256, 4 layers, 4/2 heads, vocab 512; both sides load the same HF folder
and the same tokenizer, whose eos is unreachable so both generate exactly 32 tokens), 8 prompts x
4 samples x 32 new tokens per step, AdamW at the same lr, grad clip 1, one optimizer step per step,
fp32, 2 threads, the trivial reward of trivial_reward.py. hybridrl runs in .venv
(grpo_hybridrl_side.py, timing_s/step from TensorBoard), TRL in .venv-bench (grpo_trl_side.py).
The first step of every run is warm-up and is skipped.

    .venv/bin/python benchmarks/bench_grpo_vs_trl.py [--rounds 3] [--steps 4] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess

import benchlib as bl

LR = 1e-5
TRL_PY = os.path.join(bl.ROOT, ".venv-bench", "bin", "python")
STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights")


def hybridrl_overrides(run_dir: str, steps: int) -> list:
    w = bl.WORK
    return [f"model.path={bl.bench_model_folder()}", f"data.tokenizer={bl.bench_tokenizer_folder()}",
            f"data.train_files=[{w}/data/train.parquet]", f"data.val_files=[{w}/data/test.parquet]",
            "data.max_response_length=32", "data.train_batch_size=8", "rollout.n=4",
            "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=32",
            "actor.log_prob_micro_batch_size_per_gpu=32", f"actor.optim.lr={LR}", "actor.optim.clip_grad=1.0",
            f"reward.custom_function.path={bl.ROOT}/benchmarks/trivial_reward.py",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.progress_bar=false", "trainer.logger=[tensorboard]", "trainer.save_freq=0",
            "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}/ckpt", f"trainer.log_dir={run_dir}/tb"]


def _env() -> dict:
    from dist_helper import free_port

    return dict(os.environ, OMP_NUM_THREADS="2", MASTER_PORT=str(free_port()),
                PYTHONPATH=os.path.join(bl.ROOT, "benchmarks"))


def trl_versions() -> str:
    code = "import trl, accelerate, datasets; print(trl.__version__, accelerate.__version__, datasets.__version__)"
    trl, acc, ds = subprocess.run([TRL_PY, "-c", code], capture_output=True, text=True).stdout.split()
    return f"TRL {trl}, accelerate {acc}, datasets {ds} (in .venv-bench)"


def run_hybridrl(run_dir: str, steps: int) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [os.path.join(bl.ROOT, ".venv", "bin", "python"), os.path.join(bl.ROOT, "benchmarks", "grpo_hybridrl_side.py")]
    proc = subprocess.run(cmd + hybridrl_overrides(run_dir, steps), cwd=bl.ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"hybridrl side failed:\n{proc.stderr[-3000:]}")
    s = bl.read_scalars(os.path.join(run_dir, "tb"))
    keep = range(2, steps + 1)
    return {"step_s": [s["timing_s/step"][i] for i in keep], "completion_len": [s["response_length/mean"][i] for i in keep],
            "stages": {k: [s[f"timing_s/{k}"][i] for i in keep] for k in STAGES if f"timing_s/{k}" in s}}


def run_trl(run_dir: str, steps: int, prompts_json: str) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [TRL_PY, os.path.join(bl.ROOT, "benchmarks", "grpo_trl_side.py"), bl.bench_model_folder(),
           bl.bench_tokenizer_folder(), prompts_json, run_dir, str(steps), str(LR)]
    proc = subprocess.run(cmd, cwd=bl.ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"TRL side failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"step_s": out["step_s"][1:], "completion_len": out["completion_len"][1:],
            "stages": {"generate (HF generate)": out["generate_s"][1:],
                       "generate + score + advantages": out["score_s"][1:]}}


def _prompts_json() -> str:
    """The hybridrl side's synthetic arith prompts, as TRL's plain-text prompts (same tokens)."""
    from hybridrl.data_synthetic import arith_rows

    path = os.path.join(bl.WORK, "trl_prompts.json")
    json.dump([r["prompt"][0]["content"] for r in arith_rows(2000, 1, "train")], open(path, "w"))
    return path


def report(runs: list, rounds: int, steps: int) -> str:
    pool = {side: [t for r in runs for t in r[side]["step_s"]] for side in ("hybridrl", "trl")}
    rows = [[i + 1, f"{bl.median(r['hybridrl']['step_s']):.3f}", f"{bl.median(r['trl']['step_s']):.3f}",
             f"{bl.median(r['hybridrl']['step_s']) / bl.median(r['trl']['step_s']):.2f}x"] for i, r in enumerate(runs)]
    h, t = bl.median(pool["hybridrl"]), bl.median(pool["trl"])
    rows.append(["all", f"**{h:.3f}**", f"**{t:.3f}**", f"**{h / t:.2f}x**"])
    stage_rows = []
    for side, total in (("hybridrl", h), ("trl", t)):
        names = runs[0][side]["stages"]
        for k in names:
            v = bl.median([x for r in runs for x in r[side]["stages"][k]])
            stage_rows.append([{"hybridrl": "hybridrl", "trl": "TRL"}[side], k, f"{v:.3f}", f"{100 * v / total:.0f}%"])
    lens = {side: sorted({x for r in runs for x in r[side]["completion_len"]}) for side in pool}
    verdict = "met" if h / t <= 0.5 else f"missed: hybridrl is {h / t / 0.5:.1f}x off the target"
    return (f"## GRPO step: hybridrl vs TRL GRPOTrainer\n\n"
            f"Median seconds per step (steps 2..{steps} of each run; {rounds} rounds, hybridrl A then TRL B), "
            f"8 prompts x 4 samples x 32 tokens, fp32, 2 threads, AdamW lr {LR:g}.\n\n"
            + bl.table(["round", "hybridrl s/step", "TRL s/step", "hybridrl / TRL"], rows)
            + f"\n\nTarget hybridrl <= 0.5x TRL: **{h / t:.2f}x** ({verdict}). Mean response lengths seen: "
            f"hybridrl {lens['hybridrl']}, TRL {lens['trl']}.\n\nStage medians (hybridrl: timing_s/*; TRL: its "
            f"generation methods timed; the rest of its step is the training forward/backward and AdamW):\n\n"
            + bl.table(["side", "stage", "s", "share of step"], stage_rows) + f"\n\nPeer: {trl_versions()}.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if not os.path.exists(TRL_PY):
        raise SystemExit("no .venv-bench: python3 -m venv .venv-bench && .venv-bench/bin/pip install "
                         "-r requirements.txt -r requirements-bench.txt && .venv-bench/bin/pip install --no-deps -e .")
    prompts = _prompts_json()
    runs = []
    for i in range(args.rounds):
        runs.append({"hybridrl": run_hybridrl(os.path.join(bl.WORK, f"grpo_hybridrl_{i}"), args.steps),
                     "trl": run_trl(os.path.join(bl.WORK, f"grpo_trl_{i}"), args.steps, prompts)})
        print(f"round {i + 1}: hybridrl {runs[-1]['hybridrl']['step_s']} TRL {runs[-1]['trl']['step_s']}", flush=True)
    text = report(runs, args.rounds, args.steps)
    print(text)
    if not args.no_write:
        bl.write_section("grpo", text)


if __name__ == "__main__":
    main()
