"""GPU benchmark for one H200 (unattended, ~2 min; benchmarks/gpu_check.sh runs it): actor MFU, native
rollout vs HF generate, weight handoff vs device memcpy, peak memory vs the planner.

Random weights, bf16, the architectures of configs/qwen2_0.5b.yaml and configs/qwen2_1.5b.yaml:
1. Actor forward + backward through megatron-core's schedule (the trainer's path, log-prob loss), at
   the 0.5B and 1.5B shapes: MFU = 6 * params * tokens / seconds / 989e12 (H200 dense bf16 peak;
   attention FLOPs not counted, so this understates it at long sequences). Target: >= 35% at 1.5B.
   Each row names the layer spec and core attention that ran: Transformer Engine's where it is
   installed, else the local spec with SDPAttention (torch's fused attention kernels).
2. NativeEngine rollout tokens/s at batch 64 (128 prompt + 128 new tokens, no eos), greedy and
   sampled, against transformers `generate` on the same weights in the same process. Target: >= 3x.
3. `reshard.update_engine_weights` of the 0.5B actor into a NativeEngine on the same GPU, on both of
   its copy paths: the direct one (the engine takes the actor's shards as they are, as at equal TP) and
   the resharded one (megatron tensors written into the engine's own layout, digests grouped in 64 MiB
   buckets, as when the layouts differ; forced here), each with and without fingerprint verification,
   against the device's sustained copy: the median of MEMCPY_COPIES (20) copies per rep of at least
   256 MiB (far past the L2 cache) into a buffer allocated once, timed in alternation with the handoffs.
   Target: handoff >= 50% of memcpy bandwidth.
4. With `--memory-from TB_DIR -- OVERRIDES`: the peak allocated memory of each trainer stage of a run
   (its TensorBoard `perf/max_memory_allocated_gb/<stage>`, median over steps 2..N; gpu_check.sh
   passes its 10-step GRPO run) against the planner's phase for the same config (`planner.estimate`
   at world size 1, less the planner's fixed runtime overhead, which torch's allocator does not see).
   Target: every phase within 10%. Measured on a real run because the planner's phases are those of
   a training step (optimizer state, offload, the rollout engine), which a bare forward lacks. The
   rollout phase is the trainer's `generate_sequences` stage (wake_up, generate, sleep: the engine's
   window inside `gen`, which also spans the offload before it and the onload after it).

    python benchmarks/bench_gpu.py [--fragment FILE] [--memory-from TB_DIR -- OVERRIDES...]   # needs CUDA
    python benchmarks/bench_gpu.py --smoke [...]   # tiny sizes on CPU: checks the script end to end

OVERRIDES are the run's overrides of configs/tiny_cpu.yaml. The table is printed, and FILE gets a copy
(the RESULTS.md section `gpu` is assembled by benchmarks/gpu_check.py from it and the other stages).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import benchlib as bl

PEAK_BF16 = 989e12
FULL = dict(micro=8, seq=1536, iters=6, batch=64, prompt=128, new=128, reps=3, memcpy_min=256 * 2**20)
SMOKE = dict(micro=2, seq=32, iters=2, batch=4, prompt=8, new=8, reps=2, memcpy_min=2**20)
SIZE = dict(FULL)
DEVICE = "cuda"
GIB = 2 ** 30
TINY = os.path.join(bl.ROOT, "configs", "tiny_cpu.yaml")
# trainer stage (StageTimer name) -> planner phase
PHASES = {"generate_sequences": "rollout", "reward": "reward model", "old_log_prob": "actor log-prob",
          "ref": "ref log-prob", "values": "critic log-prob", "update_critic": "critic update",
          "update_actor": "actor update"}


def config_spec(config: str, smoke: bool = False):
    """GPTSpec of configs/<config>.yaml's architecture (smoke: same head layout, tiny widths)."""
    from hybridrl.config.io import load_config
    from hybridrl.models.gpt import GPTSpec

    m = load_config(os.path.join(bl.ROOT, "configs", f"{config}.yaml"), []).model
    if smoke:
        m = dataclasses.replace(m, num_layers=2, hidden_size=8 * m.num_attention_heads, intermediate_size=128,
                                vocab_size=1000)
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


def build(spec):
    from hybridrl.models.gpt import build_gpt, for_this_machine

    spec = for_this_machine(spec)  # the Transformer Engine spec where TE is installed
    return build_gpt(spec, 1, 1, 0, "bfloat16"), spec


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
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step()
    seconds = sorted(_sync_time(step) for _ in range(iters))[iters // 2]
    params = sum(p.numel() for p in model.parameters())
    tokens = micro * seq
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    attention = type(model.decoder.layers[0].self_attention.core_attention).__name__
    return {"params": params, "tokens": tokens, "seconds": seconds, "size": f"{micro}x{seq}",
            "mfu": 6 * params * tokens / seconds / PEAK_BF16, "peak_gib": peak,
            "layer_spec": f"{spec.layer_spec} layer spec, {attention}"}


def hf_peer(weights: dict, spec):
    import torch
    import transformers

    from hybridrl.models.hf_config import hf_config_from_spec

    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in hf_config_from_spec(spec, "qwen2", "bfloat16").items()
                                         if k not in ("architectures", "model_type")})
    hf = transformers.Qwen2ForCausalLM(hf_cfg).to(device=DEVICE, dtype=torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)  # tied: lm_head is the embedding
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF peer did not take the weights: missing {missing}, unexpected {unexpected}")
    return hf


def rollout(engine, hf, spec) -> dict:
    import torch

    from hybridrl.rollout.base import SamplingParams

    batch, prompt, new = SIZE["batch"], SIZE["prompt"], SIZE["new"]
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


PATHS = ("direct", "resharded")
MEMCPY_COPIES = 20
"""The handoff's two copy paths: the engine takes the actor's shards as they are (equal TP: the trainer's
path here), or megatron tensors written into its own layout (any other layout: TP or PP differ, PP > 1)."""


def _handoff_path(path: str):
    """The resharded path forced where the layouts would allow the direct one."""
    import contextlib
    from unittest import mock

    from hybridrl.placement import reshard

    return contextlib.nullcontext() if path == "direct" else mock.patch.object(reshard, "takes_shards",
                                                                               lambda *a: False)


def handoff(engine, model, spec, groups) -> dict:
    """Seconds per handoff on each path (median; verified and not) and the device's sustained copy
    (seconds per byte: median of MEMCPY_COPIES copies per rep into a buffer allocated once)."""
    import torch

    from hybridrl.placement.reshard import update_engine_weights

    out = {}
    for path in PATHS:
        with _handoff_path(path):
            # warm-up, the byte count and the peak memory (metered here only: metering slows a handoff down)
            report = update_engine_weights(engine, model, spec, groups, 64, measure_memory=True, share=False)
            if report.direct != (path == "direct"):
                raise RuntimeError(f"the {path} handoff took the {'direct' if report.direct else 'resharded'} path")
            out[path] = {"bytes": report.total_bytes, "peak_extra_gib": report.peak_cuda_extra_bytes / 2**30,
                         "buckets": report.num_buckets}
    src = torch.ones(max(out["direct"]["bytes"], SIZE["memcpy_min"]), dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros_like(src)  # allocated and touched once: the handoff writes existing parameters too
    memcpy = lambda: dst.copy_(src)
    memcpy()
    times = {(path, verify): [] for path in PATHS for verify in ("fingerprint", "off")}
    times["memcpy"] = []
    for _ in range(SIZE["reps"]):
        for path, verify in [k for k in times if k != "memcpy"]:
            with _handoff_path(path):
                times[path, verify].append(_sync_time(
                    lambda: update_engine_weights(engine, model, spec, groups, 64, verify=verify, share=False)))
            times["memcpy"] += [_sync_time(memcpy) for _ in range(MEMCPY_COPIES)]
    for path, verify in [k for k in times if k != "memcpy"]:
        out[path]["verified" if verify == "fingerprint" else "unverified"] = bl.median(times[path, verify])
    out["memcpy"], out["memcpy_bytes"] = bl.median(times["memcpy"]), src.numel()
    return out


def memory_vs_planner(tb_dir: str, overrides: list) -> list:
    """[stage, phase, measured GiB or None, planned GiB] for each planner phase the run's stages map to."""
    from gpu_check import median_after_first

    from hybridrl.config.io import load_config
    from hybridrl.planner.plan import estimate
    from hybridrl.tokenizer import load_tokenizer

    cfg = load_config(TINY, overrides)
    plan = estimate(cfg, 1, vocab_size=load_tokenizer(cfg.data.tokenizer).vocab_size)
    planned = {p.name: (p.total - p.bytes("runtime/")) / GIB for p in plan.phases}
    scalars = bl.read_scalars(tb_dir)
    rows = []
    for stage, phase in PHASES.items():
        series = scalars.get(f"perf/max_memory_allocated_gb/{stage}")
        if phase in planned and (series or f"timing_s/{stage}" in scalars):
            rows.append([stage, phase, median_after_first(series) if series else None, planned[phase]])
    return rows


def report(mfus: dict, roll: dict, hand: dict, memory: list, failed: dict) -> str:
    """The table of whatever has been measured so far, a row per failed part."""
    rows = []
    for name, m in mfus.items():
        rows.append([f"actor fwd+bwd, {name} ({m['layer_spec']})", f"{m['tokens']} tokens ({m['size']})",
                     f"{m['seconds'] * 1000:.1f} ms",
                     f"**MFU {100 * m['mfu']:.1f}%** ({m['params'] / 1e6:.0f}M params, peak {m['peak_gib']:.1f} GiB)"])
    for mode, r in roll.items():
        rows.append([f"rollout {mode}, 0.5B", f"batch {SIZE['batch']}, {SIZE['prompt']}+{SIZE['new']} tokens",
                     f"native {r['native']:,.0f} tok/s",
                     f"HF {r['hf']:,.0f} tok/s: **native / HF {r['native'] / r['hf']:.2f}x**"])
    for path in PATHS if hand else ():  # shards (padded vocab) or HF tensors: a few bytes apart, so bandwidths
        h = hand[path]
        gb, memcpy_gbps = h["bytes"] / 1e9, hand["memcpy_bytes"] / 1e9 / hand["memcpy"]
        for kind in ("verified", "unverified"):
            rows.append([f"handoff {kind}, {path} path, 0.5B -> native engine",
                         f"{gb:.2f} GB" + (f", {h['buckets']} buckets of 64 MiB" if path == "resharded" else ""),
                         f"{h[kind] * 1000:.0f} ms ({gb / h[kind]:.1f} GB/s)",
                         f"memcpy {memcpy_gbps:.1f} GB/s: **{100 * gb / h[kind] / memcpy_gbps:.1f}% of memcpy** "
                         f"(peak extra {h['peak_extra_gib']:.2f} GiB)"])
    for stage, phase, measured, planned in memory:
        result = (f"**measured / planned {measured / planned:.2f}x**" if measured is not None
                  else "not measured (no CUDA memory metrics in the run)")
        shown = "-" if measured is None else f"{measured:.2f} GiB"
        rows.append([f"peak memory, stage `{stage}` vs planner phase \"{phase}\"", f"planned {planned:.2f} GiB",
                     shown, result])
    rows += [[part, "-", "-", f"**FAILED**: {error}"] for part, error in failed.items()]
    return bl.table(["what", "size", "time / rate", "result"], rows)


def run_parts(args, emit) -> dict:
    """Each measurement in turn; one that fails is recorded (`emit` rewrites the table after each)."""
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream
    from hybridrl.parallel.distributed import init_distributed, init_model_parallel
    from hybridrl.rollout.native import NativeEngine

    out = {"mfus": {}, "roll": {}, "hand": {}, "memory": [], "failed": {}}

    def part(name, key, fn, sub=None):
        try:
            result = fn()
            if sub is None:
                out[key] = result
            else:
                out[key][sub] = result
        except Exception as e:  # an unattended run: the other measurements still count
            traceback.print_exc()
            out["failed"][name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        emit(out)

    if args.memory_from:
        part("peak memory vs planner", "memory", lambda: memory_vs_planner(args.memory_from, args.overrides))
    init_distributed()
    groups = init_model_parallel(1, 1)
    for name in ("qwen2_1.5b", "qwen2_0.5b"):  # the 0.5B model stays for the rollout and handoff parts
        model, spec = build(config_spec(name, args.smoke))
        part(f"actor MFU {name}", "mfus", lambda: actor_mfu(model, spec), sub=name)
    weights = {n: t.detach().clone() for n, t in mcore_to_hf_stream(model, spec, groups)}
    engine_spec = dataclasses.replace(spec, layer_spec="local")  # the engine's own build, as in roles.build_rollout
    engine = NativeEngine(engine_spec, 1, dtype="bfloat16", pad_id=0, eos_id=None, max_num_seqs=SIZE["batch"])
    engine.load_weights(weights.items())
    part("rollout vs generate", "roll", lambda: rollout(engine, hf_peer(weights, spec), spec))
    del weights
    part("handoff vs memcpy", "hand", lambda: handoff(engine, model, spec, groups))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fragment", help="also write the table to this file (rewritten after each measurement)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, on CPU without CUDA")
    p.add_argument("--memory-from", metavar="TB_DIR", help="TensorBoard folder of a training run: its per-stage "
                   "peak memory against the planner for the OVERRIDES (of configs/tiny_cpu.yaml) after --")
    p.add_argument("overrides", nargs="*", help="the run's config overrides (with --memory-from)")
    args = p.parse_args()
    import torch

    global DEVICE
    if args.smoke:
        SIZE.update(SMOKE)
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device and a CUDA build of torch (--smoke runs tiny on CPU)")

    def emit(parts):
        if args.fragment:
            with open(args.fragment, "w") as f:
                f.write(report(**parts) + "\n")

    parts = run_parts(args, emit)
    print(report(**parts))
    for name, error in parts["failed"].items():
        print(f"FAILED {name}: {error}")
    return 1 if parts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
