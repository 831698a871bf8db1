"""GPU benchmark for one H200 (unattended, < 5 min): actor MFU and native rollout vs HF generate.

A Qwen2-0.5B-shaped model (configs/qwen2_0.5b.yaml's architecture, random weights, bf16):
1. Actor forward + backward through megatron-core's schedule (the trainer's path, log-prob loss):
   MFU = 6 * params * tokens / seconds / 989e12 (H200 dense bf16 peak; attention FLOPs not counted).
2. NativeEngine rollout tokens/s at batch 64 (128 prompt + 256 new tokens, no eos), greedy and
   sampled, against transformers `generate` on the same weights in the same process (the ratio).

    python benchmarks/bench_gpu.py [--no-write]     # needs a CUDA build of torch 2.13 + requirements.txt
    .venv/bin/python benchmarks/bench_gpu.py --smoke  # tiny sizes on CPU: checks the script runs end to end

Writes its section to RESULTS.md and, when $OUT is set (the device runner), to $OUT/gpu_section.md.
"""
from __future__ import annotations

import argparse
import os
import time

import benchlib as bl

PEAK_BF16 = 989e12
FULL = dict(micro=8, seq=1536, iters=6, batch=64, prompt=128, new=256)
SMOKE = dict(micro=2, seq=32, iters=2, batch=4, prompt=8, new=8)
SIZE = dict(FULL)
DEVICE = "cuda"


def qwen2_05b_spec(smoke: bool = False):
    import dataclasses

    from hybridrl.config_io import load_config
    from hybridrl.models.gpt import GPTSpec

    m = load_config(os.path.join(bl.ROOT, "configs", "qwen2_0.5b.yaml"), []).model
    if smoke:  # same head layout (14 heads, 2 KV heads), tiny widths
        m = dataclasses.replace(m, num_layers=2, hidden_size=112, intermediate_size=128, vocab_size=1000)
    return GPTSpec(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                   num_key_value_heads=m.num_key_value_heads, intermediate_size=m.intermediate_size,
                   vocab_size=m.vocab_size, max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
                   rms_norm_eps=m.rms_norm_eps, qkv_bias=m.architecture == "qwen2",
                   tie_word_embeddings=m.tie_word_embeddings)


def _sync_time(fn) -> float:
    import torch

    torch.cuda.synchronize()  # a no-op on CPU (hybridrl's CPU patches)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def actor_mfu(model, spec) -> dict:
    import torch

    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.logprobs import vocab_parallel_log_probs

    micro, seq, iters = SIZE["micro"], SIZE["seq"], SIZE["iters"]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (micro, seq), device=DEVICE, generator=g)
    batch = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]

    def loss_fn(output, mb):
        lp = vocab_parallel_log_probs(output[:, :-1], mb["input_ids"][:, 1:], None, spec.vocab_size)
        return -lp.mean(), {}

    step = lambda: pipeline_forward(model, batch, loss_fn, forward_only=False)
    for _ in range(2):
        step()
    seconds = sorted(_sync_time(step) for _ in range(iters))[iters // 2]
    params = sum(p.numel() for p in model.parameters())
    tokens = micro * seq
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    return {"params": params, "tokens": tokens, "seconds": seconds, "size": f"{micro}x{seq}",
            "mfu": 6 * params * tokens / seconds / PEAK_BF16, "peak_gib": peak}


def rollout(model, spec, groups) -> dict:
    import torch
    import transformers

    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream
    from hybridrl.models.hf_config import hf_config_from_spec
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.native import NativeEngine

    weights = {n: t.detach().clone() for n, t in mcore_to_hf_stream(model, spec, groups)}
    batch, prompt, new = SIZE["batch"], SIZE["prompt"], SIZE["new"]
    engine = NativeEngine(spec, 1, dtype="bfloat16", pad_id=0, eos_id=None, max_batch_size=batch)
    engine.load_weights(weights.items())
    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in hf_config_from_spec(spec, "qwen2", "bfloat16").items()
                                         if k not in ("architectures", "model_type")})
    hf = transformers.Qwen2ForCausalLM(hf_cfg).to(device=DEVICE, dtype=torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)  # tied: lm_head is the embedding
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF peer did not take the weights: missing {missing}, unexpected {unexpected}")
    prompts = torch.randint(3, spec.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        sp = SamplingParams(temperature=temperature, max_new_tokens=new, seed=1)
        ids = prompts.to(DEVICE)
        hf_kw = dict(do_sample=mode == "sampled", max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                     **({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if mode == "sampled" else {}))
        native = lambda: engine.generate(prompts.tolist(), sp)
        hf_gen = lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), **hf_kw)
        engine.generate(prompts[:8].tolist(), SamplingParams(temperature=temperature, max_new_tokens=8))  # warm-up
        hf.generate(ids[:8], attention_mask=torch.ones_like(ids[:8]), **dict(hf_kw, max_new_tokens=8, min_new_tokens=8))
        times = {"native": [], "hf": []}
        for _ in range(2):  # A B A B
            times["native"].append(_sync_time(native))
            times["hf"].append(_sync_time(hf_gen))
        out[mode] = {k: batch * new / min(v) for k, v in times.items()}
    return out


def report(mfu: dict, roll: dict) -> str:
    rows = [["actor fwd+bwd", f"{mfu['tokens']} tokens ({mfu['size']})", f"{mfu['seconds'] * 1000:.1f} ms",
             f"**MFU {100 * mfu['mfu']:.1f}%** ({mfu['params'] / 1e6:.0f}M params, peak {mfu['peak_gib']:.1f} GiB)"]]
    for mode, r in roll.items():
        rows.append([f"rollout {mode}", f"batch {SIZE['batch']}, {SIZE['prompt']}+{SIZE['new']} tokens",
                     f"native {r['native']:,.0f} tok/s",
                     f"HF {r['hf']:,.0f} tok/s: **native / HF {r['native'] / r['hf']:.2f}x**"])
    return ("## GPU (H200): actor MFU and native rollout, Qwen2-0.5B shape, bf16, random weights\n\n"
            + bl.table(["what", "size", "time / rate", "result"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (or GPU); never writes RESULTS.md")
    args = p.parse_args()
    import torch

    global DEVICE
    if args.smoke:
        SIZE.update(SMOKE)
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device and a CUDA build of torch (--smoke runs tiny on CPU)")
    from hybridrl.models.gpt import build_gpt
    from hybridrl.parallel.distributed import init_distributed, init_model_parallel

    init_distributed()
    groups = init_model_parallel(1, 1)
    spec = qwen2_05b_spec(args.smoke)
    model = build_gpt(spec, 1, 1, 0, "bfloat16")
    text = report(actor_mfu(model, spec), rollout(model, spec, groups))
    print(text)
    if args.smoke:
        return
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_section.md"), "w") as f:
            f.write(text + "\n")
    if not args.no_write:
        bl.write_section("gpu", text, ("torch", "megatron-core", "transformers"))


if __name__ == "__main__":
    main()
