"""Rollout tokens/s: hybridrl's NativeEngine (lean path) vs transformers `generate` (its default dynamic
KV cache, and its static KV cache, `cache_implementation="static"`) and vs the engine's megatron
static-inference path, same weights, same process.

Two cases, greedy and sampled (T=1, no top-k/top-p), batch 1, 8, 32, 32-token prompts:
- fixed: the bench Qwen2 (hidden 256, 4 layers, 4/2 heads, vocab 512, fp32), exactly 32 new tokens
  (no stop ids on the engines, min_new_tokens on HF);
- varied: the same shape with initializer_range 0.1 (less uniform logits), up to 64 new tokens and 16
  stop ids (every 32nd id) on all sides, so rows stop between 1 and 64 tokens. HF's sampled side adds
  the engine's per-request Gumbel noise to its logits and takes the argmax, so it draws the same tokens
  and stops at the same lengths as the engine (HF's own sampler would stop elsewhere).
HF's static cache runs eager on CPU: transformers compiles the forward of a static-cache `generate` only
on CUDA/XPU/TPU/Neuron devices (`_valid_auto_compile_criteria`; on CPU only with CompileConfig's private
`_compile_all_devices` flag, "for testing purposes"), so on CPU it is the static cache without
torch.compile; with --device cuda it is compiled as transformers does by default.
Tokens/s counts generated tokens. Calls rotate the peers every round; medians are compared. The
fixed case also reports the matmul-only time of the same tokens (the GEMMs of the lean path alone, on
its weights) as the bound of any engine that does this arithmetic. Runs in one gloo (or NCCL) process:
the engine needs torch.distributed.

    .venv/bin/python benchmarks/bench_rollout.py [--rounds 5] [--device cpu|cuda] [--threads 2] [--no-write]
"""
from __future__ import annotations

import argparse
import os

import benchlib as bl

PROMPT_LEN, BATCHES, MODES, PEERS = 32, (1, 8, 32), ("greedy", "sampled"), ("lean", "megatron", "hf", "hf-static")
HF_PEERS = ("hf", "hf-static")
CASES = {"fixed": dict(new=32, stops=(), model={}),
         "varied": dict(new=64, stops=tuple(range(3, 512, 32)), model=dict(initializer_range=0.1))}


def _prompts(batch: int, vocab: int):
    import torch

    return torch.randint(3, vocab, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))


def _sampling(case: str, mode: str):
    from hybridrl.rollout.base import SamplingParams

    c = CASES[case]
    return SamplingParams(temperature=0.0 if mode == "greedy" else 1.0, max_new_tokens=c["new"], seed=1,
                          stop_token_ids=c["stops"])


def _engine(folder: str):
    from safetensors.torch import load_file

    from hybridrl.models.hf_config import load_hf_config, spec_from_hf_config
    from hybridrl.rollout.native import NativeEngine

    spec = spec_from_hf_config(load_hf_config(folder))
    engine = NativeEngine(spec, 1, pad_id=0, eos_id=None)
    engine.load_weights(load_file(f"{folder}/model.safetensors").items())
    return engine


def _engine_noise(batch: int, seed: int, device):
    """HF LogitsProcessor adding the engine's Gumbel noise of request i (prompt seed seed + i)."""
    import torch
    import transformers

    from hybridrl.rollout.base import gumbel_noise, row_keys, sample_seed

    keys = row_keys([sample_seed(seed + i, 0) for i in range(batch)], device)

    class EngineNoise(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            index = torch.full((scores.shape[0],), input_ids.shape[1] - PROMPT_LEN, device=scores.device)
            return scores.float() + gumbel_noise(keys, index, scores.shape[-1])

    return transformers.LogitsProcessorList([EngineNoise()])


def _runners(case: str, device: str):
    """{peer: run(mode, prompts) -> (responses [B, new] pad-filled on CPU, generated tokens)}, engine."""
    import torch
    import transformers

    c = CASES[case]
    folder = bl.bench_model_folder(case if c["model"] else "model", **c["model"])
    engine = _engine(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()

    def native(decode):
        def run(mode, prompts):
            engine.decode = decode
            out = engine.generate(prompts.tolist(), _sampling(case, mode))
            return out.responses, int(out.response_mask.sum())
        return run

    def hf_generate(mode, prompts, cache=None):
        ids = prompts.to(device)
        kw = dict(max_new_tokens=c["new"], pad_token_id=0, attention_mask=torch.ones_like(ids))
        if cache:
            kw["cache_implementation"] = cache
        if c["stops"]:
            kw.update(eos_token_id=list(c["stops"]), do_sample=False)
            if mode == "sampled":
                kw["logits_processor"] = _engine_noise(len(ids), 1, ids.device)
        else:
            kw.update(min_new_tokens=c["new"], do_sample=mode == "sampled")
            if mode == "sampled":
                kw.update(temperature=1.0, top_k=0, top_p=1.0)
        out = hf.generate(ids, **kw)[:, PROMPT_LEN:].cpu()
        full = torch.zeros(len(ids), c["new"], dtype=torch.long)
        full[:, :out.shape[1]] = out
        return full, int(_hf_lengths(full, c["stops"]).sum())

    return {"lean": native("lean"), "megatron": native("megatron"), "hf": hf_generate,
            "hf-static": lambda mode, prompts: hf_generate(mode, prompts, "static")}, engine


def _hf_lengths(responses, stops):
    """Tokens up to and including the first stop id of each row (all of them without stops)."""
    import torch

    width = responses.shape[1]
    if not stops:
        return torch.full((responses.shape[0],), width)
    hit = torch.isin(responses, torch.tensor(stops))
    first = torch.where(hit.any(-1), hit.float().argmax(-1) + 1, torch.full_like(hit[:, 0], width, dtype=torch.long))
    return first


def _matmul_only(engine, batch: int, new: int):
    """() -> None running the lean path's GEMMs for batch prompts of PROMPT_LEN + new tokens, nothing else."""
    import torch

    from hybridrl.rollout.lean_decode import LeanGPT

    lean = LeanGPT(engine.model, engine.spec, engine.groups)
    ffn, attn = lean.layers[0].fc2.shape[0], lean.heads * lean.dim
    dev, dt = lean.device, lean.dtype
    shapes = {"pre": batch * PROMPT_LEN, "step": batch}
    x = {k: (torch.randn(m, lean.hidden, device=dev, dtype=dt), torch.randn(m, attn, device=dev, dtype=dt),
             torch.randn(m, ffn, device=dev, dtype=dt)) for k, m in shapes.items()}

    def forward(kind):
        h, a, f = x[kind]
        for w in lean.layers:
            torch.mm(h, w.qkv)  # (+ the bias of addmm: noise at this size)
            torch.mm(a, w.proj)
            torch.mm(h, w.fc1)
            torch.mm(f, w.fc2)
        torch.mm(x["step"][0], lean.output)  # the head sees one row per sequence, in prefill too

    def run():
        forward("pre")
        for _ in range(new - 1):
            forward("step")
        if dev.type == "cuda":
            torch.cuda.synchronize()

    return run


def _measure(case: str, rounds: int, device: str) -> dict:
    """{(mode, batch): {"times": {peer: [s]}, "tokens": {peer: n}, "same": {...}}} of one case."""
    import torch

    runners, engine = _runners(case, device)
    vocab, res = engine.spec.vocab_size, {}
    matmul = {b: _matmul_only(engine, b, CASES[case]["new"]) for b in BATCHES} if case == "fixed" else {}
    for run in [lambda r=r: r("sampled", _prompts(8, vocab)) for r in runners.values()] + list(matmul.values()):
        run()  # warm-up: first-call allocations, lazy imports
    for r in range(rounds):
        for mode in MODES:
            for batch in BATCHES:
                cell, prompts, outs = res.setdefault((mode, batch), {"times": {}, "tokens": {}}), _prompts(batch, vocab), {}
                cell.setdefault("samples", []).append(bl.sample())
                k = r % len(PEERS)
                for name in PEERS[k:] + PEERS[:k]:  # rotate who goes first
                    t, (outs[name], cell["tokens"][name]) = bl.timed(runners[name], mode, prompts)
                    cell["times"].setdefault(name, []).append(t)
                if mode == "greedy" and batch in matmul:  # the bound, timed beside its peers
                    cell.setdefault("matmul", []).append(bl.timed(matmul[batch])[0])
                cell["same"] = {name: torch.equal(outs["lean"], outs[name]) for name in PEERS[1:]}
    return res, runners, vocab


def body(rounds: int, device: str, threads: int) -> dict:
    """Runs in the gloo process: measurements of both cases and the profiles of the lean path."""
    import torch

    from hybridrl.parallel.distributed import init_model_parallel

    torch.set_num_threads(threads)
    init_model_parallel(1, 1)
    out, runners = {}, {}
    for case in CASES:
        out[case], runners[case], vocab = _measure(case, rounds, device)
    run = lambda name: runners["fixed"][name]("greedy", _prompts(32, vocab))  # noqa: E731
    out["profile"] = bl.profile_top(lambda: run("lean"), 16)
    out["ops"] = {name: bl.op_table(lambda n=name: run(n), 14) for name in ("lean",) + HF_PEERS}
    return out


# ---- report ----------------------------------------------------------------------------------------

def _rate(cell, name):
    return cell["tokens"][name] / bl.median(cell["times"][name])


def _speed_table(res: dict) -> tuple[str, dict]:
    rows, ratios = [], {}
    for case in CASES:
        for (mode, batch), cell in res[case].items():
            rate = {n: _rate(cell, n) for n in PEERS}
            stronger = max(HF_PEERS, key=rate.get)
            ratios[(case, mode, batch)] = (rate["lean"] / rate["hf"], rate["lean"] / rate["hf-static"])
            same = ", ".join(f"{peer}: {'yes' if ok else 'no'}" for peer, ok in cell["same"].items())
            rows.append([case, mode, batch, cell["tokens"]["lean"]] + [f"{rate[n]:,.0f}" for n in PEERS]
                        + [f"{rate['lean'] / rate['hf']:.2f}x", f"{rate['lean'] / rate['hf-static']:.2f}x",
                           f"**{rate['lean'] / rate[stronger]:.2f}x** ({stronger})",
                           f"{rate['lean'] / rate['megatron']:.2f}x", same] + bl.stamp(cell["samples"]))
    header = ["case", "mode", "batch", "tokens", "lean tok/s", "megatron-static tok/s", "HF tok/s",
              "HF static-cache tok/s", "lean / HF", "lean / HF static", "lean / stronger HF", "lean / megatron-static",
              "token-identical to lean"] + bl.STAMP_HEADER
    return bl.table(header, rows), ratios


def _bound_table(fixed: dict) -> str:
    rows = []
    for batch in BATCHES:
        cell = fixed[("greedy", batch)]
        ms = {n: bl.median(cell["times"][n]) for n in ("lean",) + HF_PEERS}
        mm = bl.median(cell["matmul"])
        rows.append([batch, f"{ms['lean'] * 1e3:.1f}", f"{mm * 1e3:.1f}", f"{ms['hf'] * 1e3:.1f}",
                     f"{ms['hf-static'] * 1e3:.1f}", f"{ms['lean'] / mm:.2f}x", f"**{ms['hf'] / mm:.2f}x**",
                     f"**{ms['hf-static'] / mm:.2f}x**"] + bl.stamp(cell["samples"]))
    return bl.table(["batch", "lean ms", "matmul-only ms", "HF ms", "HF static ms", "lean / matmul-only",
                     "HF / matmul-only (ceiling of lean / HF)", "HF static / matmul-only (ceiling of lean / HF static)"]
                    + bl.STAMP_HEADER, rows)


def _verdicts(ratios: dict) -> tuple[str, list]:
    """Per target: the ratios against each HF peer; the verdict is against the stronger peer of each cell."""
    lines, summary = [], []
    for batch, target in ((32, 3.0), (8, 2.0)):
        cells = [(f"{case} {mode}", dyn, static) for (case, mode, b), (dyn, static) in ratios.items() if b == batch]
        worst = min(min(d, st) for _, d, st in cells)
        verdict = "met" if worst >= target else f"missed; worst by {target / worst:.2f}x"
        lines.append(f"Target lean >= {target:g}x HF at batch {batch}, against the stronger HF peer of each cell: "
                     + ", ".join(f"{name} {min(d, st):.2f}x (dynamic {d:.2f}x, static {st:.2f}x)" for name, d, st in cells)
                     + f" ({verdict})")
        summary.append([f"native rollout >= {target:g}x HF generate at batch {batch}",
                        f"against the stronger of HF dynamic / static cache: "
                        + ", ".join(f"{name} **{min(d, st):.2f}x**" for name, d, st in cells), verdict])
    return "\n\n".join(lines), summary


def report(res: dict, rounds: int, device: str, threads: int) -> tuple:
    """(section text, Summary rows)."""
    speed, ratios = _speed_table(res)
    verdicts, summary = _verdicts(ratios)
    stamp = bl.stamp([x for case in CASES for cell in res[case].values() for x in cell["samples"]])
    ops = "".join(f"\n\ntorch.profiler, {name} greedy fixed at batch 32, ops by self time:\n\n```\n{t}\n```"
                  for name, t in res["ops"].items())
    compiled = "compiled as transformers does on CUDA" if device == "cuda" else \
        "eager: transformers compiles a static-cache generate only on CUDA/XPU/TPU/Neuron, not on CPU"
    text = (f"## Rollout: NativeEngine vs transformers generate\n\n"
            f"Median tokens/s over {rounds} rotating rounds, {PROMPT_LEN}-token prompts, device {device}, "
            f"{threads} threads, fp32. fixed: exactly 32 new tokens; varied: up to 64, 16 stop ids "
            f"(rows stop at 1-64 tokens; `tokens` = generated tokens of the call). lean = the default "
            f"path (own KV cache, SDPA with GQA, continuous batching); megatron-static = the engine's "
            f"megatron forward with StaticInferenceContext (the previous default); HF = `generate` with its "
            f"default dynamic cache; HF static = `generate(cache_implementation=\"static\")` ({compiled}).\n\n"
            + speed + "\n\n" + verdicts + "\n\n"
            + "Matmul-only bound (fixed, greedy): the GEMMs of the same tokens on the lean path's weights "
              "(prefill, then one step per new token), nothing else.\n\n" + _bound_table(res["fixed"])
            + f"\n\n<details><summary>Profiles</summary>\n\ncProfile, lean greedy fixed at batch 32 "
              f"(top by tottime):\n\n```\n{res['profile']}\n```{ops}\n\n</details>")
    return text, [row + stamp for row in summary]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = p.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engine builds on CUDA whenever it sees one
    from dist_helper import run_distributed

    res = run_distributed(body, 1, args.rounds, args.device, args.threads, timeout=1800)[0]
    text, summary = report(res, args.rounds, args.device, args.threads)
    print(text)
    if not args.no_write:
        bl.write_section("rollout", text, summary=summary)


if __name__ == "__main__":
    main()
