"""What every benchmark shares: the bench model and tokenizer, medians, tables, RESULTS.md sections.

Benchmarks report ratios against a peer measured in the same run (never absolute timings checked
by tests). Each one rewrites only its own section of RESULTS.md (between BEGIN/END markers), with
the machine it ran on and the exact command. This module imports no hybridrl training code.
"""
from __future__ import annotations

import os
import platform
import re
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
WORK = os.path.join(ROOT, "outputs", "bench")
# outputs/ is git-ignored: on a fresh clone nothing under it exists yet, and every script writes there
os.makedirs(WORK, exist_ok=True)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # dist_helper.run_distributed

# The bench model of issue 9: a tiny Qwen2 shape, fp32, tied embeddings like the small Qwen2s.
BENCH_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                   tie_word_embeddings=True, initializer_range=0.02)
SPECIALS = ("<pad>", "<bos>", "<unk>")  # ids 0, 1, 2; eos comes last, see bench_tokenizer_folder


def bench_model_folder(name: str = "model", **sizes) -> str:
    """A random HF Qwen2 folder of BENCH_MODEL (overridden by `sizes`) under outputs/bench (cached)."""
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    spec = {**BENCH_MODEL, **sizes}
    folder = os.path.join(WORK, name + "_" + "_".join(f"{v}" for v in spec.values()))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        random_hf_model_folder(folder, "qwen2", seed=0, **spec)
    return folder


def bench_tokenizer_folder(vocab: int = 512) -> str:
    """An HF tokenizer folder: builtin:tiny's characters, filler tokens up to `vocab` ids, then eos.

    eos gets id `vocab`, one past the model's vocabulary, so no model of `vocab` logits can emit it:
    hybridrl and TRL then both generate exactly max_new_tokens with their normal stop logic in place.
    """
    folder = os.path.join(WORK, f"tokenizer_{vocab}")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    from hybridrl.tokenizer import TINY_CHARS, TINY_CHAT_TEMPLATE

    tokens = list(SPECIALS) + list(TINY_CHARS)
    tokens += [f"<t{i}>" for i in range(vocab - len(tokens))] + ["<eos>"]
    raw = RawTokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    raw.normalizer = normalizers.Lowercase()
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>",
                                 bos_token="<bos>", unk_token="<unk>")
    hf.chat_template = TINY_CHAT_TEMPLATE
    hf.save_pretrained(folder)
    return folder


# ---- measuring -------------------------------------------------------------------------------------

def timed(fn, *args, **kwargs):
    """(seconds, result) of one call."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def median(xs) -> float:
    return statistics.median(xs)


def read_scalars(folder: str, with_wall_time: bool = False):
    """{tag: {step: value}} from every TensorBoard event file under folder; with_wall_time: also
    {tag: {step: the event's wall time}} (seconds since the epoch, when the writer logged it)."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, wall = {}, {}
    for path in glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
            wall.setdefault(tag, {}).update({e.step: e.wall_time for e in acc.Scalars(tag)})
    return (out, wall) if with_wall_time else out


def profile_top(fn, n: int = 12, sort: str = "tottime") -> str:
    """cProfile one call of fn(); the top-n rows by `sort` as text (the evidence for a missed target)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(sort)
    stats.print_stats(n)
    text = buf.getvalue()
    start = text.find("ncalls")
    return text[start:].rstrip() if start >= 0 else text.rstrip()


def op_table(fn, n: int = 12) -> str:
    """torch.profiler of one call of fn(): the top-n aten ops by self CPU time, as text."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=n, max_name_column_width=36).rstrip()


# ---- reporting -------------------------------------------------------------------------------------

def table(header, rows) -> str:
    """A markdown table (printed as is to the console too)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "not installed"


def machine(extra=("torch", "megatron-core", "transformers")) -> str:
    """One line: cores, CPU model, Python and package versions."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = ", ".join(f"{name} {_version(name)}" for name in extra)
    return f"`nproc`={os.cpu_count()}, CPU: {cpu}, Python {platform.python_version()}, {versions}"


def command() -> str:
    """The command line that produced this result, relative to the repository root."""
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return " ".join([exe, script] + [shlex.quote(a) for a in sys.argv[1:]])


_HEADER = ("# Benchmark results\n\nWritten by the scripts in `benchmarks/` (see `benchmarks/README.md`); "
           "each script rewrites only its own section. Figures are ratios against a peer measured in the "
           "same run on the same machine.\n")


def write_section(name: str, body: str, extra_versions=("torch", "megatron-core", "transformers")) -> None:
    """Replace (or append) the section `name` of RESULTS.md with body + machine + command."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    block = (f"<!-- BEGIN {name} -->\n{body.rstrip()}\n\n"
             f"Machine: {machine(extra_versions)}. Run {stamp}.\n\n"
             f"Command: `{command()}`\n<!-- END {name} -->")
    text = open(RESULTS).read() if os.path.exists(RESULTS) else _HEADER
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    with open(RESULTS, "w") as f:
        f.write(text)
