"""`scripts/generate.py`: a checkpoint's first check, generating from an HF model folder on the native engine.

  python scripts/generate.py --model HF_DIR --prompts-file prompts.jsonl --max-new-tokens K --output out.jsonl
  torchrun --nproc_per_node=N scripts/generate.py --model HF_DIR --tensor-parallel-size T ...

Each prompts line is {"prompt": text} (needs a tokenizer in the model folder) or {"prompt_token_ids": [...]};
each output line, in input order, holds prompt_token_ids, output_token_ids (the stop token kept) and,
with a tokenizer, text. Any architecture the engine runs (Qwen2/Qwen3/Llama, Qwen3-MoE, Mixtral). Weights
stream from the folder's safetensors one HF tensor at a time into the engine's `load_weights`, as a
weight sync does. Processes form groups of T (rollout TP); the groups split the prompts (DP) and rank 0
writes the file. Bad input (a missing folder or file, a bad JSON line, an architecture or TP the engine
cannot run) ends in one `error: ...` line and exit code 2 (`hybridrl.log.run_cli`).
"""
from __future__ import annotations

import argparse
import json
import os
import warnings

from hybridrl.log import UsageError, run_cli

MODEL_FIX = "pass an HF model folder (config.json + *.safetensors)"
LINE_FIX = 'each line must be {"prompt": "text"} or {"prompt_token_ids": [ids]}'


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("--prompts-file", required=True, help='JSONL: {"prompt": text} or {"prompt_token_ids": [...]}')
    p.add_argument("--output", required=True, help="JSONL written by rank 0, one line per prompt")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="rollout TP (divides the process count)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest response in tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1: all")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens whatever the eos")
    return p.parse_args(argv)


def check_paths(args) -> None:
    """UsageError naming the fix for a missing model folder, prompts file or output folder, or a size < 1."""
    if not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model}: no such folder; {MODEL_FIX}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model {args.model} has no config.json; {MODEL_FIX}")
    if not any(f.endswith(".safetensors") for f in os.listdir(args.model)):
        raise UsageError(f"--model {args.model} has no *.safetensors weights; {MODEL_FIX}")
    if not os.path.isfile(args.prompts_file):
        raise UsageError(f"--prompts-file {args.prompts_file}: no such file; pass a JSONL file ({LINE_FIX})")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--output {args.output}: folder {out_dir} does not exist; create it or pass another path")
    sizes = (("--max-new-tokens", args.max_new_tokens), ("--tensor-parallel-size", args.tensor_parallel_size))
    for flag, value in sizes:
        if value < 1:
            raise UsageError(f"{flag} {value}: pass 1 or more")


def model_spec(args):
    """The GPTSpec of the folder; UsageError when --tensor-parallel-size cannot split it."""
    from hybridrl.models.hf_config import UnsupportedConfigError, check_parallel_layout, spec_from_hf_config

    try:
        spec = spec_from_hf_config(args.model)
    except UnsupportedConfigError as err:
        raise UsageError(f"--model {args.model}: {err}") from None
    try:
        check_parallel_layout(spec, args.tensor_parallel_size, 1)
    except ValueError as err:
        raise UsageError(f"--tensor-parallel-size {args.tensor_parallel_size} does not fit {args.model}: "
                         f"{err}") from None
    return spec


def folder_tokenizer(folder: str):
    """The folder's tokenizer, or None when it ships none."""
    from hybridrl.tokenizer import load_tokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(folder, n)) for n in names):
        return None
    return load_tokenizer(folder)


def _prompt_ids(entry, where: str, tokenizer, vocab: int) -> list[int]:
    if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_token_ids" in entry):
        raise UsageError(f"{where}: expected one of the keys prompt / prompt_token_ids; {LINE_FIX}")
    if "prompt" in entry:
        if not isinstance(entry["prompt"], str):
            raise UsageError(f"{where}: prompt must be a string; {LINE_FIX}")
        if tokenizer is None:
            raise UsageError(f"{where}: a text prompt needs a tokenizer, and the model folder has none; "
                             "add its tokenizer files (tokenizer.json) or pass prompt_token_ids")
        ids = tokenizer.encode(entry["prompt"])
    else:
        ids = entry["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise UsageError(f"{where}: prompt_token_ids must be a list of token ids in [0, {vocab}); {LINE_FIX}")
    if not ids:
        raise UsageError(f"{where}: the prompt is empty; every prompt needs at least one token")
    return list(ids)


def read_prompts(path: str, tokenizer, vocab: int) -> list[list[int]]:
    """Token ids per non-blank line; UsageError naming the line on anything else."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--prompts-file {path} line {number}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{where} is not JSON ({err.msg} at column {err.pos + 1}); {LINE_FIX}") from None
            prompts.append(_prompt_ids(entry, where, tokenizer, vocab))
    if not prompts:
        raise UsageError(f"--prompts-file {path} holds no prompts; {LINE_FIX}")
    return prompts


def hf_weights(folder: str, spec):
    """(HF name, full tensor) of every tensor the model needs, read one at a time."""
    from hybridrl.models import hf_convert as hc
    from hybridrl.models.hf_checkpoint import SafetensorsReader, check_checkpoint

    reader = SafetensorsReader(folder)
    check_checkpoint(reader, spec)  # CheckpointMismatchError names the tensor
    for name in hc.hf_shapes(spec):
        yield name, reader.read(name)


def output_lines(prompts, out, tokenizer) -> list[dict]:
    lines = []
    for prompt, tokens, mask in zip(prompts, out.responses.tolist(), out.response_mask.tolist()):
        line = {"prompt_token_ids": prompt, "output_token_ids": tokens[:int(sum(mask))]}
        if tokenizer is not None:
            line["text"] = tokenizer.decode(line["output_token_ids"])
        lines.append(line)
    return lines


def sampling_params(args, tokenizer):
    """The engine's SamplingParams; the stops are the tokenizer's eos ids (with generation_config.json's)."""
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.tokenizer import generation_eos_ids

    stops = () if args.ignore_eos else tokenizer.eos_token_ids if tokenizer else generation_eos_ids(args.model)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"--temperature {args.temperature} --top-p {args.top_p}: pass a temperature >= 0 "
                         "(0: greedy) and 0 < top-p <= 1")
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, seed=args.seed, stop_token_ids=tuple(stops),
                          ignore_eos=args.ignore_eos)


def run_engine(args, spec, tokenizer, prompts, sampling) -> list[dict] | None:
    """Output lines in prompt order on rank 0 (None elsewhere). Each rollout-TP group generates every
    dp-th prompt (seed + its index, so the samples do not depend on the process count)."""
    import torch.distributed as dist

    from hybridrl.parallel.distributed import destroy, init_distributed, launch_env
    from hybridrl.rollout.native import NativeEngine

    tp, world = args.tensor_parallel_size, launch_env().world_size
    if world % tp:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide the {world} process(es); launch "
                         f"torchrun --nproc_per_node with a multiple of {tp}, or pass a divisor of {world}")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "Apex is not installed" etc.
    init_distributed()
    try:
        pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
        engine = NativeEngine(spec, tp, dtype=args.dtype, pad_id=pad_id)
        engine.load_weights(hf_weights(args.model, spec), verify="off")
        mine = list(range(engine.groups.dp_rank, len(prompts), engine.groups.dp))
        out = engine.generate([prompts[i] for i in mine], sampling, [args.seed + i for i in mine])
        lines = list(zip(mine, output_lines([prompts[i] for i in mine], out, tokenizer)))
        parts = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(lines if engine.groups.tp_rank == 0 else [], parts, dst=0)
    finally:
        destroy()
    return None if parts is None else [line for _, line in sorted(p for part in parts for p in part)]


def generate(args) -> int:
    check_paths(args)
    spec = model_spec(args)
    tokenizer = folder_tokenizer(args.model)
    prompts = read_prompts(args.prompts_file, tokenizer, spec.vocab_size)
    lines = run_engine(args, spec, tokenizer, prompts, sampling_params(args, tokenizer))
    if lines is not None:
        with open(args.output, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        print(f"wrote {len(lines)} generations to {args.output}")
    return 0


def main(argv=None) -> int:
    return run_cli(generate, parse_args(argv))
