"""Rollout tokens/s: hybridrl's NativeEngine vs transformers `generate`, same model, same process.

The bench Qwen2 (hidden 256, 4 layers, 4/2 heads, vocab 512, fp32), 32 prompt tokens + exactly 32
new tokens (no eos: the engine gets no stop ids, HF gets min_new_tokens=32), greedy and sampled
(T=1, no top-k/top-p), batch 1, 8, 32, 2 threads. Runs in one gloo process (the engine needs
torch.distributed); calls alternate A B A B over the rounds and the medians are compared.

    .venv/bin/python benchmarks/bench_rollout.py [--rounds 5] [--no-write]
"""
from __future__ import annotations

import argparse

import benchlib as bl

PROMPT_LEN, NEW_TOKENS, BATCHES, MODES = 32, 32, (1, 8, 32), ("greedy", "sampled")


def _prompts(batch: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, PROMPT_LEN), generator=g)


def _native(folder: str):
    from safetensors.torch import load_file

    from hybridrl.models.hf_config import load_hf_config, spec_from_hf_config
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.native import NativeEngine

    init_model_parallel(1, 1)
    spec = spec_from_hf_config(load_hf_config(folder))
    engine = NativeEngine(spec, 1, pad_id=0, eos_id=None)
    engine.load_weights(load_file(f"{folder}/model.safetensors").items())
    return engine


def _runners(folder: str):
    """{"native"|"hf": run(mode, prompts) -> [B, NEW_TOKENS] token tensor}."""
    import torch
    import transformers

    from hybridrl.rollout.base import SamplingParams

    engine = _native(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def native(mode, prompts):
        sp = SamplingParams(temperature=0.0 if mode == "greedy" else 1.0, max_new_tokens=NEW_TOKENS, seed=1)
        return engine.generate(prompts.tolist(), sp).responses

    def hf_generate(mode, prompts):
        sampling = dict(temperature=1.0, top_k=0, top_p=1.0) if mode == "sampled" else {}
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=mode == "sampled", pad_token_id=0, **sampling)
        return out[:, PROMPT_LEN:]

    return {"native": native, "hf": hf_generate}, engine


def body(folder: str, rounds: int) -> dict:
    """Runs in the gloo process: timings {(mode, batch, engine): [s]}, greedy agreement, a profile."""
    import torch

    torch.set_num_threads(2)
    runners, engine = _runners(folder)
    vocab = engine.spec.vocab_size
    for name in ("native", "hf"):  # warm-up: first-call allocations and lazy imports
        runners[name]("sampled", _prompts(8, vocab))
    times, same = {}, {}
    for _ in range(rounds):
        for mode in MODES:
            for batch in BATCHES:
                prompts = _prompts(batch, vocab)
                outs = {}
                for name in ("native", "hf"):  # A B, every round
                    t, outs[name] = bl.timed(runners[name], mode, prompts)
                    times.setdefault((mode, batch, name), []).append(t)
                    assert outs[name].shape == (batch, NEW_TOKENS), (name, outs[name].shape)
                if mode == "greedy":
                    same[batch] = bool(torch.equal(outs["native"], outs["hf"].to(outs["native"].dtype)))
    profile = {mode: bl.profile_top(lambda m=mode: runners["native"](m, _prompts(32, vocab)), 14)
               for mode in MODES}
    profile["hf greedy"] = bl.profile_top(lambda: runners["hf"]("greedy", _prompts(32, vocab)), 8)
    ops = {name: bl.op_table(lambda r=runners[name]: r("greedy", _prompts(32, vocab)), 14) for name in ("native", "hf")}
    return {"times": times, "greedy_equal": same, "profile": profile, "ops": ops}


def report(res: dict, rounds: int) -> str:
    rows, ratio32 = [], {}
    for mode in MODES:
        for batch in BATCHES:
            tok = batch * NEW_TOKENS
            native = tok / bl.median(res["times"][(mode, batch, "native")])
            hf = tok / bl.median(res["times"][(mode, batch, "hf")])
            rows.append([mode, batch, f"{native:,.0f}", f"{hf:,.0f}", f"**{native / hf:.2f}x**"])
            if batch == 32:
                ratio32[mode] = native / hf
    verdict = ", ".join(f"{m} {r:.2f}x ({'met' if r >= 3 else f'missed by {3 / r:.1f}x'})"
                        for m, r in ratio32.items())
    equal = ", ".join(f"B={b}: {'yes' if v else 'NO'}" for b, v in sorted(res["greedy_equal"].items()))
    prof = "\n\n".join(f"cProfile, NativeEngine.generate {m} at batch 32 (top by tottime):\n\n```\n{p}\n```"
                       if m in MODES else f"cProfile, HF generate greedy at batch 32:\n\n```\n{p}\n```"
                       for m, p in res["profile"].items())
    prof += "".join(f"\n\ntorch.profiler, {name} greedy at batch 32, aten ops by self CPU time:\n\n```\n{t}\n```"
                    for name, t in res["ops"].items())
    return (f"## Rollout: NativeEngine vs transformers generate\n\n"
            f"Median tokens/s over {rounds} alternating rounds (A B A B), {PROMPT_LEN} prompt + {NEW_TOKENS} "
            f"new tokens, 2 threads, fp32.\n\n"
            + bl.table(["mode", "batch", "native tok/s", "HF tok/s", "native / HF"], rows)
            + f"\n\nTarget native >= 3x HF at batch 32: {verdict}. Greedy outputs token-identical: {equal}.\n\n"
            + f"<details><summary>Profiles</summary>\n\n{prof}\n\n</details>")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = p.parse_args()
    from dist_helper import run_distributed

    folder = bl.bench_model_folder()
    res = run_distributed(body, 1, folder, args.rounds, timeout=900)[0]
    text = report(res, args.rounds)
    print(text)
    if not args.no_write:
        bl.write_section("rollout", text)


if __name__ == "__main__":
    main()
