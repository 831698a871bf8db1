"""benchmarks/gpu_check.sh's vLLM stage: vLLM against the actor on one tiny random model, at TP = the launch's world.

    torchrun --nproc_per_node=2 benchmarks/gpu_vllm_check.py --family qwen2 --work DIR --out FILE.md

In one launch (vLLM keeps one engine per process): the actor (megatron, bf16) is built from a random HF folder
of `family` (the tiny test models of tests/data/vllm_0_33_names.json), a vLLM engine with `load_format="dummy"`
gets its weights through the verified handoff (the read-back digests every slice), then:
  names     the engine's own parameter names and shapes against the fixture's (written out when they differ:
            that is the fixture's regeneration on a GPU);
  greedy    greedy responses of vLLM, and, teacher-forced on them, the actor's argmax: the share of tokens
            that agree (bf16 near-ties may differ) and the first divergence;
  logprobs  vLLM's processed log-probs of its greedy tokens (log_softmax at T = 1) against the actor's.
PASS needs the handoff verified, the names equal, >= 95% greedy agreement and log-prob |diff| mean <= 0.02,
max <= 0.15 (bf16 on both sides). Rank 0 writes FILE.md; the exit status says PASS (0) or FAIL (1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "vllm_0_33_names.json")
LIMITS = {"agree": 0.95, "mean": 0.02, "max": 0.15}


def parameter_shapes(worker) -> dict:
    """Runs in the vLLM worker: {name: shape} of the model vLLM built."""
    from hybridrl.rollout.vllm import _model

    return {n: list(p.shape) for n, p in _model(worker).named_parameters()}


def names_diff(got: dict, want: dict) -> list:
    """Lines naming every parameter missing, extra or shaped otherwise in `got` (vLLM) than in `want` (fixture)."""
    lines = [f"missing in vLLM: {n} {want[n]}" for n in sorted(set(want) - set(got))]
    lines += [f"extra in vLLM: {n} {got[n]}" for n in sorted(set(got) - set(want))]
    return lines + [f"shape of {n}: vLLM {got[n]}, fixture {want[n]}" for n in sorted(set(got) & set(want))
                    if list(got[n]) != list(want[n])]


def compare(tokens: torch.Tensor, mask: torch.Tensor, vllm_lp: torch.Tensor, actor_lp: torch.Tensor,
            actor_argmax: torch.Tensor) -> dict:
    """Greedy agreement and log-prob differences over the response tokens (mask 1)."""
    on = mask.bool()
    agree = (actor_argmax == tokens) & on
    diff = (vllm_lp - actor_lp).abs()[on]
    rows = [int((~agree[i] & on[i]).nonzero()[0]) if (~agree[i] & on[i]).any() else None for i in range(len(tokens))]
    return {"tokens": int(on.sum()), "agree": float(agree.sum() / on.sum()), "first_divergence": rows,
            "lp_mean": float(diff.mean()), "lp_max": float(diff.max())}


def verdict(result: dict) -> bool:
    return (result["verified"] and not result["names"] and result["agree"] >= LIMITS["agree"]
            and result["lp_mean"] <= LIMITS["mean"] and result["lp_max"] <= LIMITS["max"])


def _actor_scores(model, spec, groups, prompts: list, responses: torch.Tensor, mask: torch.Tensor):
    """Teacher-forced on prompt + response: the actor's log-prob and argmax of each response token."""
    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.logprobs import shifted_log_probs

    width = len(prompts[0])  # prompts of one length; without stop tokens every response runs to the end
    ids = torch.cat([torch.tensor(prompts), responses], 1).cuda()
    attn = torch.cat([torch.ones(len(prompts), width, dtype=torch.long), mask.long()], 1).cuda()
    with torch.no_grad():
        logits = pipeline_forward(model, [{"input_ids": ids, "attention_mask": attn}])[0]["output"]
        lp = shifted_log_probs(logits, ids, groups.tp_group, spec.vocab_size)[:, width - 1:]
        parts = [torch.empty_like(logits) for _ in range(groups.tp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.tp_group)
        argmax = torch.cat(parts, -1)[..., :spec.vocab_size].argmax(-1)[:, width - 1:-1]
    return lp.float().cpu(), argmax.cpu()


def run(family: str, work: str) -> dict:
    from hybridrl.config import RolloutConfig
    from hybridrl.models.hf_checkpoint import model_from_hf, random_hf_model_folder
    from hybridrl.parallel.distributed import init_distributed, init_model_parallel
    from hybridrl.placement.reshard import update_engine_weights
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.vllm import VLLMEngine

    le = init_distributed()
    tp = le.world_size
    groups = init_model_parallel(tp, 1)
    folder = os.path.join(work, f"vllm_{family}")
    if le.rank == 0:
        random_hf_model_folder(folder, family, seed=0)
    dist.barrier()
    model, spec = model_from_hf(folder, groups, "bfloat16")
    start = time.perf_counter()
    engine = VLLMEngine(spec, RolloutConfig(name="vllm", tensor_model_parallel_size=tp, gpu_memory_utilization=0.3,
                                            enforce_eager=True, dtype="bfloat16"), max_model_len=64)
    built_s = time.perf_counter() - start
    with open(FIXTURE) as f:
        want = json.load(f)["models"][f"{family}/tp{tp}"]["params"]
    got = engine.llm.collective_rpc(parameter_shapes)[0]
    report = update_engine_weights(engine, model, spec, groups, bucket_mb=1, verify="fingerprint")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, spec.vocab_size, (8, 8), generator=g).tolist()
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16), list(range(len(prompts))))
    actor_lp, argmax = _actor_scores(model, spec, groups, prompts, out.responses, out.response_mask)
    result = compare(out.responses, out.response_mask, out.log_probs, actor_lp, argmax)
    result.update(family=family, tp=tp, verified=report.verified, buckets=report.num_buckets,
                  names=names_diff(got, want), shapes=got, engine_build_s=round(built_s, 1))
    return result


def write(result: dict, out: str) -> None:
    ok = verdict(result)
    names = f"{len(result['names'])} differences" if result["names"] else "equal"
    lines = [f"### vLLM vs actor: {result['family']} at TP {result['tp']}: {'PASS' if ok else 'FAIL'}", "",
             f"- handoff: verified={result['verified']} in {result['buckets']} buckets; engine built in "
             f"{result['engine_build_s']} s",
             f"- names and shapes against tests/data/vllm_0_33_names.json: {names}",
             f"- greedy agreement (actor argmax teacher-forced on vLLM's tokens): {result['agree']:.3f} of "
             f"{result['tokens']} tokens (limit {LIMITS['agree']}); first divergence per row: "
             f"{result['first_divergence']}",
             f"- processed log-probs |vLLM - actor|: mean {result['lp_mean']:.4f} (limit {LIMITS['mean']}), max "
             f"{result['lp_max']:.4f} (limit {LIMITS['max']})"]
    lines += [f"  - {line}" for line in result["names"][:20]]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    if result["names"]:  # the engine's own shapes: what the fixture would become
        with open(out.replace(".md", "_shapes.json"), "w") as f:
            json.dump(result["shapes"], f, indent=1, sort_keys=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=("qwen2", "qwen3", "llama", "qwen3_moe", "mixtral"))
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(args.family, args.work)
    if dist.get_rank() == 0:
        write(result, args.out)
        print(open(args.out).read())
    return 0 if verdict(result) else 1


if __name__ == "__main__":
    sys.exit(main())
