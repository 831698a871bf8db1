"""What every benchmark shares: the bench model and tokenizer, medians, tables, RESULTS.md sections.

Benchmarks report ratios against a peer measured in the same run (never absolute timings checked
by tests). Each one rewrites only its own section of RESULTS.md (between BEGIN/END markers), with
the machine it ran on and the exact command. This module imports no hybridrl training code.
"""
from __future__ import annotations

import functools
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


# ---- when and where a row was measured ------------------------------------------------------------

def sample() -> tuple:
    """(time, 1-minute load average) now: taken beside each measurement, for its row's stamp."""
    return time.time(), os.getloadavg()[0]


def wait_quiet(threshold: float = 2.5, max_s: float = 180, poll_s: float = 5) -> float:
    """Wait (at most max_s) until the 1-minute load average is below threshold (on 2 cores: about our
    own previous run and nothing else); the seconds waited."""
    start = time.time()
    while os.getloadavg()[0] >= threshold and time.time() - start < max_s:
        time.sleep(poll_s)
    return time.time() - start


def _git(*args) -> str:
    import subprocess

    out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


@functools.lru_cache(maxsize=None)  # one run, one commit
def commit() -> str:
    """HEAD's short hash; "+dirty" when the code a benchmark runs (src/, benchmarks/*.py, configs/, tests/)
    differs from it (RESULTS.md itself does not count)."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", "src", "configs", "tests", "benchmarks/*.py")
    return head + ("+dirty" if changed else "")


STAMP_HEADER = ["load 1-min", "commit", "date (UTC)"]


def stamp(samples) -> list:
    """The STAMP_HEADER cells of a row measured at `samples` ((time, load) pairs): the load range over
    its measurements, the commit, the date of its first measurement."""
    loads = [load for _, load in samples]
    lo, hi = min(loads), max(loads)
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(min(t for t, _ in samples)))
    return [f"{lo:.2f}" if hi - lo < 0.005 else f"{lo:.2f}-{hi:.2f}", commit(), when]


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
    """The command line that produced this result, relative to the repository root (an interpreter
    outside it by its name only: no machine's paths in RESULTS.md)."""
    exe = sys.executable
    exe = os.path.relpath(exe, ROOT) if exe.startswith(ROOT + os.sep) else os.path.basename(exe)
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return " ".join([exe, script] + [shlex.quote(public_path(a)) for a in sys.argv[1:]])


def public_path(text: str) -> str:
    """`text` with this checkout's root and the home directory left out (relative / `~`)."""
    text = text.replace(ROOT + os.sep, "").replace(ROOT, ".")
    home = os.path.expanduser("~")
    return text.replace(home + os.sep, "~/") if home not in ("/", "") else text


_HEADER = ("# Benchmark results\n\nWritten by the scripts in `benchmarks/` (see `benchmarks/README.md`); "
           "each script rewrites only its own section. Figures are ratios against a peer measured in the "
           "same run on the same machine.\n")


def _replace_block(text: str, name: str, block: str) -> str:
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    return pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


SUMMARY_HEADER = ["target", "measured (same-run peer)", "verdict", "section"] + STAMP_HEADER


def _update_summary(text: str, name: str, body: str, rows: list) -> str:
    """Replace section `name`'s rows of the Summary table (between `<!-- BEGIN summary -->` and
    `<!-- END summary -->`), keeping the other sections' rows and their order."""
    heading = next(line[3:] for line in body.splitlines() if line.startswith("## "))
    link = f"[{name}](#{anchor(heading)})"
    m = re.search(r"<!-- BEGIN summary -->\n(.*?)<!-- END summary -->", text, re.S)
    old = [line for line in (m.group(1).splitlines() if m else []) if line.startswith("| ")][1:]  # no header
    new = ["| " + " | ".join(str(c) for c in row[:3] + [link] + row[3:]) + " |" for row in rows]
    mine = [i for i, line in enumerate(old) if f"| [{name}](" in line]
    at = mine[0] if mine else len(old)
    kept = [line for line in old if f"| [{name}](" not in line]
    lines = kept[:at] + new + kept[at:]
    table_ = "\n".join([table(SUMMARY_HEADER, [])] + lines)
    return _replace_block(text, "summary", f"<!-- BEGIN summary -->\n{table_}\n<!-- END summary -->")


def write_section(name: str, body: str, extra_versions=("torch", "megatron-core", "transformers"),
                  summary: list | None = None) -> None:
    """Replace (or append) the section `name` of RESULTS.md with body + machine + command; `summary`:
    this benchmark's rows of the Summary table ([target, measured, verdict] + stamp cells)."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    block = (f"<!-- BEGIN {name} -->\n{body.rstrip()}\n\n"
             f"Machine: {machine(extra_versions)}. Run {when} at `{commit()}`, load average (1, 5, 15 min) "
             f"at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}.\n\n"
             f"Command: `{command()}`\n<!-- END {name} -->")
    text = open(RESULTS).read() if os.path.exists(RESULTS) else _HEADER
    text = _replace_block(text, name, block)
    if summary:
        text = _update_summary(text, name, body, summary)
    with open(RESULTS, "w") as f:
        f.write(text)
