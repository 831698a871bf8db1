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
Tokens/s counts generated tokens. Calls rotate the peers every round; medians are compared. Every
cell also reports the matmul-only time of the tokens lean generates in it (its projections, attention
and head GEMMs alone, on its weights) as the bound of any engine that does this arithmetic. One
more lean call per cell and round is instrumented (`_lean_parts`): its GEMMs as they run in the loop, the same
GEMMs again at once, its attention, and the rest, which is where lean's time beyond that bound goes. Runs in one gloo (or NCCL) process:
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


def _matmul_only(engine, lengths: list):
    """() -> None running the GEMMs of the lean path's tokens for rows of PROMPT_LEN-token prompts that
    generate `lengths` tokens each, nothing else: the bound of any engine doing this arithmetic.

    Prefill: every projection over batch x PROMPT_LEN rows, attention as batched matmuls (QK^T and PV per
    row and K/V group, the rep query heads of a group as rows) over the causal half (the full square over
    half the (row, group) pairs: the same FLOPs), the head over one row per sequence. Decode step t
    (t = 1 .. max(lengths) - 1): the rows still generating (length > t), attention over their
    PROMPT_LEN + t keys, the head over those rows. Sampling, norms, rotary and cache writes are left out.
    """
    import torch

    from hybridrl.rollout.lean_decode import LeanGPT

    lean = LeanGPT(engine.model, engine.spec, engine.groups)
    ffn, attn, dev, dt = lean.layers[0].fc2.shape[0], lean.heads * lean.dim, lean.device, lean.dtype
    batch, g, rep, d = len(lengths), lean.groups_per_rank, lean.rep, lean.dim
    live = [sum(n > t for n in lengths) for t in range(1, max(lengths))]
    rand = lambda *shape: torch.randn(*shape, device=dev, dtype=dt)  # noqa: E731
    top = batch * PROMPT_LEN
    h, a, f = rand(top, lean.hidden), rand(top, attn), rand(top, ffn)
    pairs = max(1, batch * g // 2)
    pre_q, pre_k = rand(pairs, PROMPT_LEN * rep, d), rand(pairs, PROMPT_LEN, d)
    keys = rand(batch * g, PROMPT_LEN + len(live), d)
    q = rand(batch * g, rep, d)

    def layers(m, attention):
        for w in lean.layers:
            torch.mm(h[:m], w.qkv)  # (+ the bias of addmm: noise at this size)
            attention()
            torch.mm(a[:m], w.proj)
            torch.mm(h[:m], w.fc1)
            torch.mm(f[:m], w.fc2)
        torch.mm(h[:min(m, batch)], lean.output)  # the head sees one row per sequence, in prefill too

    def run():
        layers(top, lambda: torch.bmm(torch.bmm(pre_q, pre_k.transpose(1, 2)), pre_k))
        for t, m in enumerate(live, start=1):
            k = keys[:m * g, :PROMPT_LEN + t]
            layers(m, lambda: torch.bmm(torch.bmm(q[:m * g], k.transpose(1, 2)), k))
        if dev.type == "cuda":
            torch.cuda.synchronize()

    return run


def _lean_parts(run, device: str) -> dict:
    """{part: s} of one call of run() on the lean path: its projection and head GEMMs as they run in the
    loop ("gemm"), each of them again at once on the same operands ("gemm_again": the same arithmetic with
    its weight and code just used), its attention calls ("attention") and the whole call ("total").
    Each GEMM and attention call is timed alone (a device sync on each side on CUDA), so this run is slower
    than the timed ones; its parts say where lean's time goes, not how fast it is."""
    import time

    import torch
    import torch.nn.functional as F

    import hybridrl.rollout.lean_decode as ld

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    parts = dict.fromkeys(("gemm", "gemm_again", "attention"), 0.0)
    matmul, sdpa = ld._matmul, F.scaled_dot_product_attention

    def timed(part, fn, *args, **kwargs):
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        parts[part] += time.perf_counter() - start
        return out

    def gemm(*args):
        out = timed("gemm", matmul, *args)
        timed("gemm_again", matmul, *args)
        return out

    attend = ld.LeanGPT._attend  # decode's attention (prefill's is SDPA; on CUDA decode's is too)
    timed_sdpa = lambda *a, **k: timed("attention", sdpa, *a, **k)  # noqa: E731

    def timed_attend(self, *args):  # timed once, not again through the SDPA it may call
        F.scaled_dot_product_attention = sdpa
        try:
            return timed("attention", attend, self, *args)
        finally:
            F.scaled_dot_product_attention = timed_sdpa

    ld._matmul, F.scaled_dot_product_attention, ld.LeanGPT._attend = gemm, timed_sdpa, timed_attend
    try:
        parts["total"] = bl.timed(run)[0]
    finally:
        ld._matmul, F.scaled_dot_product_attention, ld.LeanGPT._attend = matmul, sdpa, attend
    parts["total"] -= parts["gemm_again"]
    return parts


def _measure(case: str, rounds: int, device: str) -> dict:
    """{(mode, batch): {"times": {peer: [s]}, "tokens": {peer: n}, "same": {...}}} of one case."""
    import torch

    runners, engine = _runners(case, device)
    vocab, res, matmul = engine.spec.vocab_size, {}, {}
    for run in [lambda r=r: r("sampled", _prompts(8, vocab)) for r in runners.values()]:
        run()  # warm-up: first-call allocations, lazy imports
    for mode in MODES:  # each cell's bound runs the GEMMs of the tokens lean generates in it
        for batch in BATCHES:
            out, _ = runners["lean"](mode, _prompts(batch, vocab))
            matmul[(mode, batch)] = _matmul_only(engine, _hf_lengths(out, CASES[case]["stops"]).tolist())
            matmul[(mode, batch)]()
    for r in range(rounds):
        for mode in MODES:
            for batch in BATCHES:
                cell, prompts, outs = res.setdefault((mode, batch), {"times": {}, "tokens": {}}), _prompts(batch, vocab), {}
                cell.setdefault("samples", []).append(bl.sample())
                k = r % len(PEERS)
                for name in PEERS[k:] + PEERS[:k]:  # rotate who goes first
                    t, (outs[name], cell["tokens"][name]) = bl.timed(runners[name], mode, prompts)
                    cell["times"].setdefault(name, []).append(t)
                cell.setdefault("matmul", []).append(bl.timed(matmul[(mode, batch)])[0])  # beside its peers
                cell.setdefault("parts", []).append(_lean_parts(lambda: runners["lean"](mode, prompts), device))
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


BOUND_TARGET = 1.5
"""lean within this factor of its cell's matmul-only time (batch 8 and 32)."""


def _bound_table(res: dict) -> tuple[str, list]:
    """(table of every cell against its matmul-only time, Summary row for batch 8 and 32)."""
    rows, at = [], {}
    for case in CASES:
        for (mode, batch), cell in res[case].items():
            ms = {n: bl.median(cell["times"][n]) for n in ("lean",) + HF_PEERS}
            mm = bl.median(cell["matmul"])
            at[(case, mode, batch)] = ms["lean"] / mm
            rows.append([case, mode, batch, f"{ms['lean'] * 1e3:.1f}", f"{mm * 1e3:.1f}", f"**{ms['lean'] / mm:.2f}x**",
                         f"{ms['hf'] / mm:.2f}x", f"{ms['hf-static'] / mm:.2f}x"] + bl.stamp(cell["samples"]))
    table = bl.table(["case", "mode", "batch", "lean ms", "matmul-only ms", "lean / matmul-only",
                      "HF / matmul-only (ceiling of lean / HF)", "HF static / matmul-only (ceiling of lean / HF static)"]
                     + bl.STAMP_HEADER, rows)
    cells = {k: v for k, v in at.items() if k[2] in (8, 32)}
    worst = max(cells.values())
    verdict = "met" if worst <= BOUND_TARGET else f"missed; worst by {worst / BOUND_TARGET:.2f}x"
    summary = [f"native rollout lean <= {BOUND_TARGET:g}x its matmul-only time (batch 8, 32)",
               "lean / matmul-only: " + ", ".join(f"{case} {mode} b{batch} **{v:.2f}x**"
                                                  for (case, mode, batch), v in cells.items()), verdict]
    return table, summary


def _parts_table(res: dict) -> str:
    """Where lean's time goes in every cell (medians over rounds of `_lean_parts`)."""
    rows = []
    for case in CASES:
        for (mode, batch), cell in res[case].items():
            part = {k: bl.median([p[k] for p in cell["parts"]]) for k in cell["parts"][0]}
            rest = part["total"] - part["gemm"] - part["attention"]
            rows.append([case, mode, batch] + [f"{part[k] * 1e3:.1f}" for k in ("total", "gemm", "gemm_again")]
                        + [f"{part['gemm'] / part['gemm_again']:.2f}x", f"{part['attention'] * 1e3:.1f}",
                           f"{rest * 1e3:.1f}", f"{rest / part['total']:.0%}", f"{bl.median(cell['matmul']) * 1e3:.1f}"])
    return bl.table(["case", "mode", "batch", "lean ms (instrumented)", "its projections + head in the loop ms",
                     "the same GEMMs again at once ms", "in the loop / again", "attention ms",
                     "everything else ms", "everything else / lean", "matmul-only ms"], rows)


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
    bound, bound_row = _bound_table(res)
    summary.append(bound_row)
    stamp = bl.stamp([x for case in CASES for cell in res[case].values() for x in cell["samples"]])
    ops = "".join(f"\n\ntorch.profiler, {name} greedy fixed at batch 32, ops by self time:\n\n```\n{t}\n```"
                  for name, t in res["ops"].items())
    compiled = "compiled as transformers does on CUDA" if device == "cuda" else \
        "eager: transformers compiles a static-cache generate only on CUDA/XPU/TPU/Neuron, not on CPU"
    text = (f"## Rollout: NativeEngine vs transformers generate\n\n"
            f"Median tokens/s over {rounds} rotating rounds, {PROMPT_LEN}-token prompts, device {device}, "
            f"{threads} threads, fp32. fixed: exactly 32 new tokens; varied: up to 64, 16 stop ids "
            f"(rows stop at 1-64 tokens; `tokens` = generated tokens of the call). lean = the default "
            f"path (own KV cache, GQA attention without repeated K/V, continuous batching); megatron-static = the engine's "
            f"megatron forward with StaticInferenceContext (the previous default); HF = `generate` with its "
            f"default dynamic cache; HF static = `generate(cache_implementation=\"static\")` ({compiled}).\n\n"
            + speed + "\n\n" + verdicts + "\n\n"
            + "Matmul-only bound of every cell: the GEMMs of the tokens lean generates in it, on the lean "
              "path's weights, nothing else (`_matmul_only`: every projection; attention as batched matmuls "
              "over the causal half in prefill and each live row's keys when decoding; the head over one row "
              "per sequence; rows that stopped leave the steps). Timed in every round beside the peers. "
              f"Target: lean <= {BOUND_TARGET:g}x it at batch 8 and 32.\n\n" + bound
            + "\n\nWhere lean's time goes, one instrumented lean call per cell and round (`_lean_parts`; medians): "
              "each projection and head GEMM timed as it runs in the decode loop, then run again at once on the "
              "same operands (the same arithmetic, its weight and code just used), each attention call, and "
              "everything else (norms, rotary, cache writes, sampling, scheduling, Python). Timing each call "
              "alone makes this call slower than the timed ones.\n\n" + _parts_table(res)
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

    # a round is 12 cells x 4 peers + bounds: minutes on 2 quiet cores, many more on a loaded machine
    res = run_distributed(body, 1, args.rounds, args.device, args.threads, timeout=900 * (args.rounds + 2))[0]
    text, summary = report(res, args.rounds, args.device, args.threads)
    print(text)
    if not args.no_write:
        bl.write_section("rollout", text, summary=summary)


if __name__ == "__main__":
    main()
