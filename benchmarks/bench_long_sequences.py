"""Long sequences: packed rows vs padded rows, context parallelism on one 16k-token row, sequence parallelism.

    python benchmarks/bench_long_sequences.py [--reps 3] [--long 16384] [--no-write]

(a) The actor's update pass (forward + backward of the per-token log-prob and entropy function) and its
    log-prob pass (forward only) over rows shaped like reasoning traces: prompts of 20-120 tokens, responses
    log-normal (median ~400) between 32 and 4096 tokens. Padded rows (trimmed to each micro-batch's real
    columns, the pre-packing path) against packed rows (`model.use_remove_padding`), at equal rows per
    micro-batch, and each with its token budget (`use_dynamic_bsz`: padded counts rows x width, packed real
    tokens). Computed tokens = what attention and the MLPs ran over. 1 process, 2 threads, alternating reps.
(b) One row of `--long` tokens, forward + backward: the peak of new storages alive at once on a rank
    (`placement.reshard.LiveTensorMeter`: activations, logits, temporaries; gradients preallocated) at CP 1
    and at CP 2 (two gloo processes, one thread each), and the time of the step.
(c) The same measurement per rank at TP 2 for 4 rows of 2048 tokens, sequence parallelism on and off.
The model: the bench Qwen2 shape (hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 512), fp32.
"""
from __future__ import annotations

import argparse
import random
import time

import benchlib as bl

ROWS, MICRO_ROWS, MAX_RESPONSE, MAX_PROMPT = 32, 4, 4096, 120


def trace_lengths(seed: int = 0):
    rng = random.Random(seed)
    prompts = [rng.randint(20, MAX_PROMPT) for _ in range(ROWS)]
    responses = [max(32, min(MAX_RESPONSE, int(rng.lognormvariate(6.0, 1.0)))) for _ in range(ROWS)]
    return prompts, responses


def _model(groups, **overrides):
    from hybridrl.models.hf_checkpoint import model_from_hf

    folder = bl.bench_model_folder("long", max_position_embeddings=32768)
    return model_from_hf(folder, groups, "float32", **overrides)


def _actor_fns(groups, vocab):
    """The actor's token_fn (log-probs and entropy of the next token) and a loss over the response."""
    from hybridrl.models.logprobs import vocab_parallel_token_stats

    def token_fn(logits, labels):
        lp, ent = vocab_parallel_token_stats(logits, labels, groups.tp_group, vocab, 1.0, True)
        return {"log_probs": lp, "entropy": ent}

    def loss_fn(tokens, mb):
        r = mb["response_mask"].shape[1]
        s = mb["input_ids"].shape[1]
        window = (tokens["log_probs"] + 0.01 * tokens["entropy"])[:, s - r - 1:s - 1]
        return (window * mb["response_mask"]).sum() / mb["response_mask"].sum().clamp(min=1), {}

    return token_fn, loss_fn


def packing_body(reps: int) -> dict:
    import torch

    from hybridrl.config.batching import MicroBatching
    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.packing import Pack
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.workers.micro_batches import plan_micro_batches, split_rows

    torch.set_num_threads(2)
    groups = init_model_parallel(1, 1)
    p, r = trace_lengths()
    pmask = (torch.arange(MAX_PROMPT)[None] >= (MAX_PROMPT - torch.tensor(p))[:, None]).long()
    rmask = (torch.arange(MAX_RESPONSE)[None] < torch.tensor(r)[:, None]).long()
    mask = torch.cat([pmask, rmask], 1)
    batch = {"input_ids": torch.randint(3, 500, mask.shape) * mask, "attention_mask": mask,
             "response_mask": rmask.float()}
    budget = MAX_PROMPT + MAX_RESPONSE
    models = {"padded": _model(groups)[0], "packed": _model(groups, remove_padding=True)[0]}
    token_fn, loss_fn = _actor_fns(groups, 512)
    variants = {}
    for layout in ("padded", "packed"):
        for split, batching in ((f"{MICRO_ROWS} rows", MicroBatching(MICRO_ROWS)),
                                (f"budget {budget}", MicroBatching(MICRO_ROWS, budget, layout == "packed"))):
            mbs = split_rows(batch, plan_micro_batches(batch, batching))
            computed = sum(Pack.length(mb["attention_mask"]) if layout == "packed" else mb["input_ids"].numel()
                           for mb in mbs)
            variants[f"{layout}, {split}"] = (models[layout], mbs, computed)
    out = {name: {"update": [], "log_prob": [], "samples": [], "micro": len(v[1]), "computed": v[2]}
           for name, v in variants.items()}
    for _ in range(reps):
        for name, (model, mbs, _) in variants.items():
            out[name]["samples"].append(bl.sample())
            for key, forward_only in (("update", False), ("log_prob", True)):
                start = time.perf_counter()
                pipeline_forward(model, mbs, loss_fn, forward_only=forward_only, token_fn=token_fn)
                out[name][key].append(time.perf_counter() - start)
                model.zero_grad(set_to_none=False)
    return {"real": int(mask.sum()), "variants": out}


def _measured_step(model, groups, batch):
    """(peak bytes of new storages during one forward + backward, seconds); gradients preallocated."""
    import torch

    from hybridrl.models.forward import pipeline_forward
    from hybridrl.placement.reshard import LiveTensorMeter

    token_fn, loss_fn = _actor_fns(groups, 512)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    pipeline_forward(model, [batch], loss_fn, forward_only=False, token_fn=token_fn)  # warm-up
    start = time.perf_counter()
    with LiveTensorMeter() as meter:
        pipeline_forward(model, [batch], loss_fn, forward_only=False, token_fn=token_fn)
    return meter.peak, time.perf_counter() - start


def _rows(n_rows: int, length: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (n_rows, length), generator=g)
    response = torch.ones(n_rows, length // 2)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response}


def memory_body(tp: int, cp: int, overrides: dict, n_rows: int, length: int) -> dict:
    import torch

    from hybridrl.parallel.distributed import init_model_parallel

    torch.set_num_threads(1 if tp * cp > 1 else 2)
    groups = init_model_parallel(tp, 1, cp=cp)
    model, _ = _model(groups, context_parallel_size=cp, **overrides)
    peak, seconds = _measured_step(model, groups, _rows(n_rows, length))
    return {"peak": peak, "s": seconds, "samples": [bl.sample()]}


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from dist_helper import run_distributed

    pack = run_distributed(packing_body, 1, args.reps, timeout=3600)[0]
    v = pack["variants"]
    base = v[f"padded, {MICRO_ROWS} rows"]
    rows_a = [[name, x["micro"], f"{x['computed']:,}", f"{bl.median(x['update']):.3f}",
               f"**{bl.median(x['update']) / bl.median(base['update']):.2f}x**", f"{bl.median(x['log_prob']):.3f}",
               f"**{bl.median(x['log_prob']) / bl.median(base['log_prob']):.2f}x**"] + bl.stamp(x["samples"])
              for name, x in v.items()]
    packed_fixed = v[f"packed, {MICRO_ROWS} rows"]
    ratio_a = bl.median(packed_fixed["update"]) / bl.median(base["update"])

    long_rows = {"CP 1": run_distributed(memory_body, 1, 1, 1, {"remove_padding": True}, 1, args.long,
                                         timeout=3600)[0],
                 "CP 2": run_distributed(memory_body, 2, 1, 2, {"remove_padding": True}, 1, args.long,
                                         timeout=3600)[0]}
    ratio_b = long_rows["CP 2"]["peak"] / long_rows["CP 1"]["peak"]
    rows_b = [[name, _mib(x["peak"]), f"**{x['peak'] / long_rows['CP 1']['peak']:.2f}x**", f"{x['s']:.2f}"]
              + bl.stamp(x["samples"]) for name, x in long_rows.items()]
    sp_rows = {f"TP 2, SP {state}": run_distributed(memory_body, 2, 2, 1, {"sequence_parallel": state == "on",
                                                                           "remove_padding": True}, 4, 2048,
                                                    timeout=3600)[0] for state in ("off", "on")}
    off = sp_rows["TP 2, SP off"]["peak"]
    rows_c = [[name, _mib(x["peak"]), f"**{x['peak'] / off:.2f}x**", f"{x['s']:.2f}"] + bl.stamp(x["samples"])
              for name, x in sp_rows.items()]
    text = ("## Long sequences: packed rows, context parallelism, sequence parallelism\n\n"
            f"(a) {ROWS} rows, prompts 20-{MAX_PROMPT} tokens, responses log-normal 32-{MAX_RESPONSE} "
            f"({pack['real']:,} real tokens in all); the actor's update (forward + backward) and log-prob pass "
            f"(forward), median of {args.reps} alternating reps, 1 process, 2 threads; the peer is padded rows "
            f"at {MICRO_ROWS} rows per micro-batch (trimmed to their real columns).\n\n"
            + bl.table(["layout, micro-batches", "micro-batches", "computed tokens", "update s", "vs padded",
                        "log-prob s", "vs padded"] + bl.STAMP_HEADER, rows_a)
            + f"\n\n(b) One row of {args.long:,} tokens, forward + backward, peak of new storages alive at once on "
            "one rank (gradients preallocated), 1 thread per rank:\n\n"
            + bl.table(["layout", "peak MiB per rank", "vs CP 1", "step s"] + bl.STAMP_HEADER, rows_b)
            + "\n\n(c) 4 rows of 2,048 tokens at TP 2, packed, peak per rank as in (b):\n\n"
            + bl.table(["layout", "peak MiB per rank", "vs SP off", "step s"] + bl.STAMP_HEADER, rows_c))
    summary = [["packed update <= 0.6x padded at equal rows (traces 32-4096)", f"{ratio_a:.2f}x",
                "met" if ratio_a <= 0.6 else "missed"] + bl.stamp(packed_fixed["samples"]),
               [f"{args.long // 1024}k-token row: CP 2 peak per rank <= 0.6x CP 1", f"{ratio_b:.2f}x",
                "met" if ratio_b <= 0.6 else "missed"] + bl.stamp(long_rows["CP 2"]["samples"])]
    print(text)
    if not args.no_write:
        bl.write_section("long_sequences", text, summary=summary)


if __name__ == "__main__":
    main()
