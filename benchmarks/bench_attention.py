"""CPU training step of the local layer spec: SDPAttention (torch's fused kernels) vs megatron's unfused
DotProductAttention, on the same model in the same process.

Forward + backward of a loss over the real tokens of left-padded rows (the trainer's explicit
[B, 1, S, S] mask), fp32, for the tiny demo model at its batch and for a wider GQA model at sequence
256 and 512. Each repeat times both paths in alternating order (the core attention modules are swapped,
no weights move); times are CPU seconds of the calling thread with one torch thread (other processes'
load on a shared machine does not enter them, as it does wall time); medians and the ratio are
reported, with the bytes autograd saves for backward (deduplicated by storage, parameters excluded)
and the largest logit difference at real tokens.
`.venv/bin/python benchmarks/bench_attention.py [--reps 7] [--no-write]`
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time

import benchlib

CASES = {  # name -> (GPTSpec fields, batch, sequence)
    "tiny demo (h64, 2 layers, 4/2 heads)": (dict(hidden_size=64, num_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, intermediate_size=128, vocab_size=128), 256, 40),
    "wide s256 (h512, 4 layers, 8/2 heads)": (dict(hidden_size=512, num_layers=4, num_attention_heads=8,
                                                   num_key_value_heads=2, intermediate_size=1408, vocab_size=1024), 8, 256),
    "wide s512 (h512, 4 layers, 8/2 heads)": (dict(hidden_size=512, num_layers=4, num_attention_heads=8,
                                                   num_key_value_heads=2, intermediate_size=1408, vocab_size=1024), 4, 512),
}


def _batch(vocab: int, b: int, s: int):
    """Left-padded prompts of 1/2 to full length, right-padded responses (the trainer's rows)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    start = torch.randint(0, s // 2, (b,), generator=g)
    end = s - torch.randint(0, s // 8 + 1, (b,), generator=g)
    cols = torch.arange(s)
    mask = ((cols >= start[:, None]) & (cols < end[:, None])).long()
    return ids * mask, mask


class _Swap:
    """Toggle every layer's core attention between SDPAttention and megatron's DotProductAttention."""

    def __init__(self, model):
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        self.layers = [layer.self_attention for layer in model.decoder.layers]
        self.modules = {"sdpa": [a.core_attention for a in self.layers],
                        "unfused": [DotProductAttention(config=a.config, layer_number=a.layer_number,
                                                        attn_mask_type=AttnMaskType.causal, attention_type="self",
                                                        pg_collection=a.pg_collection) for a in self.layers]}

    def use(self, kind: str):
        for attn, module in zip(self.layers, self.modules[kind]):
            attn.core_attention = module


def _step(model, ids, mask, saved=None):
    """Forward + backward of a weighted sum of the real tokens' logits; returns the logits."""
    import torch

    from hybridrl.models.forward import causal_padding_mask
    from hybridrl.parallel.cpu_compat import cuda_to_cpu, without_cuda_mode

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if saved is not None and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    b, s = ids.shape
    with cuda_to_cpu(), without_cuda_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, torch.arange(s).expand(b, s), causal_padding_mask(mask, s))
        loss = (logits.float().mean(-1) * mask).sum()
    loss.backward()
    return logits.detach()


def _measure(reps: int):
    import torch

    from hybridrl.models.gpt import GPTSpec, build_gpt
    from hybridrl.parallel.distributed import init_model_parallel

    torch.set_num_threads(1)  # all the work on this thread: its CPU time is the step's
    init_model_parallel(1, 1)
    out = {}
    for name, (fields, b, s) in CASES.items():
        model = build_gpt(GPTSpec(max_position_embeddings=s, **fields), 1, 1, 0)
        swap, (ids, mask) = _Swap(model), _batch(fields["vocab_size"], b, s)
        times, saved, logits = {"sdpa": [], "unfused": []}, {}, {}
        for kind in ("sdpa", "unfused"):  # warm-up, saved bytes and logits
            swap.use(kind)
            saved[kind] = {}
            logits[kind] = _step(model, ids, mask, saved[kind])
        for rep in range(reps):
            for kind in (("sdpa", "unfused") if rep % 2 == 0 else ("unfused", "sdpa")):
                swap.use(kind)
                start = time.thread_time()
                _step(model, ids, mask)
                times[kind].append(time.thread_time() - start)
        real = mask.bool()
        out[name] = dict(b=b, s=s, times=times, saved={k: sum(v.values()) for k, v in saved.items()},
                         diff=(logits["sdpa"] - logits["unfused"])[real].abs().max().item())
    return out


def _report(results, reps, load_before, load_after) -> str:
    rows = []
    for name, r in results.items():
        sdpa, unfused = benchlib.median(r["times"]["sdpa"]), benchlib.median(r["times"]["unfused"])
        rows.append([name, f"{r['b']} x {r['s']}", f"{unfused * 1e3:.1f}", f"{sdpa * 1e3:.1f}",
                     f"**{sdpa / unfused:.2f}x**", f"{r['saved']['unfused'] / 2**20:.1f}",
                     f"{r['saved']['sdpa'] / 2**20:.1f}", f"{r['diff']:.1e}"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=benchlib.ROOT).stdout.strip()
    header = ["model", "batch x seq", "unfused CPU ms", "sdpa CPU ms", "sdpa / unfused", "unfused saved MiB",
              "sdpa saved MiB", "max logit diff"]
    return ("## Attention: SDPAttention vs megatron's unfused core attention (CPU training step)\n\n"
            f"Forward + backward of the local layer spec, fp32, left- and right-padded rows with the trainer's "
            f"explicit [B, 1, S, S] mask, median of {reps} alternating repeats per path on one model in one "
            f"process, CPU time of the calling thread (one torch thread); saved = bytes autograd keeps for "
            f"backward (parameters excluded). "
            f"Commit {commit}; load average {load_before} before, {load_after} after.\n\n"
            + benchlib.table(header, rows) + NOTE)


NOTE = ("\n\nThe projections' and MLP's matrix products dominate a CPU step at these widths, so the step gains "
        "only what the attention's own ops cost (scores, mask fill, softmax and their backward, K and V "
        "repeated to every head), most at the longest sequence; the saved bytes fall by the a x s x s scores "
        "per layer (SDPA keeps none). On a GPU the fused kernels never hold an s x s tensor at all: "
        "`benchmarks/gpu_check.sh` measures the training step there (MFU, with the attention that ran).")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from dist_helper import run_distributed

    load_before = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    results = run_distributed(_measure, 1, args.reps)[0]
    load_after = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    body = _report(results, args.reps, load_before, load_after)
    print(body)
    if not args.no_write:
        benchlib.write_section("attention", body)


if __name__ == "__main__":
    main()
