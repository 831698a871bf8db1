"""Metrics: stage timers, batch statistics with verl's names, and one writer for console, TensorBoard and W&B.

Metrics are a flat dict of namespaced floats (`actor/pg_loss`, `timing_s/gen`); only rank 0 writes.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections import defaultdict
from typing import Dict, Iterable

import torch


class StageTimer:
    """`with timer("gen"):` accumulates wall time into `timing_s/gen` for the current step.

    On CUDA it also keeps each stage's peak allocated memory (`perf/max_memory_allocated_gb/gen`),
    the measured side of the planner's phases, and rank 0's peaks over the step's stages
    (`perf/max_memory_allocated_gb`, `perf/max_memory_reserved_gb`: reset every step, generation included;
    verl logs a worker's lifetime peak as `actor/perf/...`). Stages may nest (`gen` holds
    `generate_sequences`, the engine's own window): an inner stage's peak counts for the outer ones too.
    """

    def __init__(self):
        self.seconds: Dict[str, float] = defaultdict(float)
        self.peak_bytes: Dict[str, int] = defaultdict(int)
        self.reserved_bytes = 0
        self.cuda = torch.cuda.is_available()
        self._open: list = []
        self.on_span = None
        """Called as on_span(name, start, end) (time.perf_counter seconds) when a stage ends: a timeline."""
        self.on_enter = self.on_leave = None
        """Called as on_enter(name) / on_leave(failed) around each stage: a hang watchdog."""

    def _record_peak(self, names) -> None:
        """Fold the allocator's peak since its last reset into `names` (then reset it)."""
        peak = torch.cuda.max_memory_allocated()
        for name in names:
            self.peak_bytes[name] = max(self.peak_bytes[name], peak)
        self.reserved_bytes = max(self.reserved_bytes, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            self._record_peak(self._open)
        self._open.append(name)
        if self.on_enter is not None:
            self.on_enter(name)
        start, failed = time.perf_counter(), False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            end = time.perf_counter()
            if self.on_leave is not None:
                self.on_leave(failed)
            self.seconds[name] += end - start
            if self.on_span is not None:
                self.on_span(name, start, end)
            if self.cuda:
                self._record_peak(self._open)
            self._open.pop()

    def metrics(self) -> Dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        if self.peak_bytes:
            out.update({f"perf/max_memory_allocated_gb/{k}": b / 2**30 for k, b in self.peak_bytes.items()})
            out["perf/max_memory_allocated_gb"] = max(self.peak_bytes.values()) / 2**30
            out["perf/max_memory_reserved_gb"] = self.reserved_bytes / 2**30
        return out

    def reset(self) -> None:
        self.seconds.clear()
        self.peak_bytes.clear()
        self.reserved_bytes = 0


def _stats(prefix: str, x: torch.Tensor) -> Dict[str, float]:
    x = x.float()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def _stats_or_nan(prefix: str, x: torch.Tensor) -> Dict[str, float]:
    """_stats, or NaN for each where x is empty (as verl when every response was aborted)."""
    if x.numel() == 0:
        return {f"{prefix}/{k}": float("nan") for k in ("mean", "max", "min")}
    return _stats(prefix, x)


def _masked_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    valid = x[mask.bool()].float()
    if valid.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return _stats(prefix, valid)


def batch_metrics(scores, token_rewards, advantages, returns, response_mask, max_response_length,
                  prompt_mask=None, values=None, rm_scores=None,
                  response_attention_mask=None, max_prompt_length=None) -> Dict[str, float]:
    """verl's data metrics: critic/score, rewards, advantages, returns, values, response_length, and
    critic/rm_score when a reward model scored the batch. As verl, a row with an empty response is aborted:
    score and reward statistics leave it out (NaN if every row is), response/aborted_ratio counts it, and
    response_length_non_aborted/* are the lengths of the others.

    Lengths count every real response token (tool output included, as verl), the rest the loss mask."""
    real = response_mask if response_attention_mask is None else response_attention_mask
    lengths = real.sum(-1).float()
    kept = lengths > 0  # verl's aborted rows: an empty response, left out of the score and reward statistics
    out = {}
    out.update(_stats_or_nan("critic/score", scores[kept]))
    if rm_scores is not None:
        out.update(_stats("critic/rm_score", rm_scores))
    # as verl: each row's summed token rewards, unmasked (they are zero past the response already), so a row or
    # token that rejection sampling left out of the loss keeps its reward here
    out.update(_stats_or_nan("critic/rewards", token_rewards.sum(-1)[kept]))
    out.update(_masked_stats("critic/advantages", advantages, response_mask))
    out.update(_masked_stats("critic/returns", returns, response_mask))
    if values is not None:
        out.update(_masked_stats("critic/values", values, response_mask))
        out.update(_explained_variance(returns, values, response_mask))
    out.update(_stats("response_length", lengths))
    out["response_length/clip_ratio"] = (lengths >= max_response_length).float().mean().item()
    out.update(_stats_or_nan("response_length_non_aborted", lengths[kept]))
    out["response_length_non_aborted/clip_ratio"] = (
        (lengths[kept] >= max_response_length).float().mean().item() if kept.any() else float("nan"))
    out["response/aborted_ratio"] = 1.0 - kept.float().mean().item()
    if prompt_mask is not None:
        prompt_lengths = prompt_mask.sum(-1).float()
        out.update(_stats("prompt_length", prompt_lengths))
        if max_prompt_length:  # verl's: the share of prompts at the limit (likely truncated)
            out["prompt_length/clip_ratio"] = (prompt_lengths >= max_prompt_length).float().mean().item()
    return out


def _explained_variance(returns, values, mask) -> Dict[str, float]:
    """verl's critic/vf_explained_var: 1 - Var(returns - values) / (Var(returns) + 1e-5) over the response tokens
    (unbiased variances, as torch.var); absent below two tokens."""
    keep = mask.bool()
    r, v = returns[keep].double(), values[keep].double()
    if r.numel() < 2:
        return {}
    return {"critic/vf_explained_var": (1.0 - torch.var(r - v) / (torch.var(r) + 1e-5)).item()}


def throughput_metrics(timings: Dict[str, float], num_tokens: int, world_size: int) -> Dict[str, float]:
    step = timings.get("timing_s/step", 0.0)
    return {"perf/total_num_tokens": float(num_tokens),
            "perf/throughput": num_tokens / step / world_size if step > 0 else 0.0}


def mean_of(dicts: Iterable[Dict[str, float]]) -> Dict[str, float]:
    """Average the per-micro-batch metric dicts of an update."""
    sums, counts = defaultdict(float), defaultdict(int)
    for d in dicts:
        for k, v in d.items():
            sums[k] += float(v)
            counts[k] += 1
    return {k: sums[k] / counts[k] for k in sums}


WANDB_INSTALL = "pip install -e .[wandb]"


class LoggerError(ValueError):
    """A metric sink that cannot start; the message names the fix."""


def wandb_mode() -> str:
    """`online` once the user has logged in (WANDB_API_KEY, or `wandb login`'s netrc entry), else `offline`;
    an explicit WANDB_MODE wins."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def _line_step(line: str):
    """The step of one file-logger line; None for a blank or damaged one (a write cut short), which goes."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


STEP_KEY = "training/global_step"
"""The x axis of every W&B chart: a field of each logged row, not W&B's own `step`."""


class MetricsWriter:
    """Console lines, TensorBoard scalars, a Weights & Biases run and verl's file logger (JSON lines at
    $VERL_FILE_LOGGER_PATH, else <log_dir>/metrics.jsonl; appended to, and cut back to the resumed step on a
    resume); a no-op on ranks other than 0.

    `sinks` are verl's `trainer.logger` names. W&B gets the project and experiment names, the resolved
    config (`config`, a plain dict) and its run folder under `log_dir`; offline unless the user logged in.
    A step's figures may come after the next step's (split placement's perf/overlap of step k is known after
    step k+1): W&B drops `run.log(step=k)` below its current step, so every metric is plotted against
    `training/global_step` (define_metric), logged as a field of each row."""

    def __init__(self, sinks, log_dir: str, enabled: bool, project: str = "hybridrl", experiment: str = "",
                 config: dict | None = None):
        if "wandb" in sinks:  # on every rank, so that no rank goes on alone when the package is missing
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise LoggerError(f"trainer.logger includes wandb but the wandb package is not installed; "
                                  f"install it with `{WANDB_INSTALL}` or drop wandb from trainer.logger")
        self.enabled = enabled
        self.console = enabled and "console" in sinks
        self.tb = None
        self.wandb = None
        self.log_dir = log_dir
        self._generations = []  # the W&B table's rows so far: W&B takes a whole table per log
        self.file = None
        if enabled and "file" in sinks:  # verl's file logger: {"step": k, "data": {...}} per line
            self.file_path = os.environ.get("VERL_FILE_LOGGER_PATH") or os.path.join(log_dir, "metrics.jsonl")
            os.makedirs(os.path.dirname(os.path.abspath(self.file_path)), exist_ok=True)
            self.file = open(self.file_path, "a", encoding="utf-8")
        if enabled and "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.tb = SummaryWriter(log_dir=log_dir)
        if enabled and "wandb" in sinks:
            import wandb

            os.makedirs(log_dir, exist_ok=True)
            self.wandb = wandb.init(project=project, name=experiment or None, dir=log_dir, config=config or {},
                                    mode=wandb_mode(), reinit="create_new")
            self.wandb.define_metric(STEP_KEY)
            self.wandb.define_metric("*", step_metric=STEP_KEY)

    def resumed_at(self, step: int) -> None:
        """The run goes on from a checkpoint of step `step`: TensorBoard drops what an earlier run logged in this
        folder past it (a SessionLog START at step + 1, what SummaryWriter(purge_step=) writes), so a curve
        resumed from an older checkpoint continues from there instead of holding both runs' later points."""
        if self.tb is not None:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            self.tb._get_file_writer().add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
            self.tb.flush()
        if self.file is not None:  # the lines past `step` go (rewritten whole: temp + rename), the rest stay
            self.file.close()
            with open(self.file_path, encoding="utf-8") as f:
                kept = [line for line in f if (at := _line_step(line)) is not None and at <= step]
            tmp = f"{self.file_path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, self.file_path)
            self.file = open(self.file_path, "a", encoding="utf-8")

    def log(self, metrics: Dict[str, float], step: int, console_keys=None, console: bool = True) -> None:
        """TensorBoard and W&B always; a console line (console_keys, else all) when `console`."""
        if not self.enabled:
            return
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({**metrics, STEP_KEY: step})
        if self.file is not None:
            data = {k: float(v) if math.isfinite(float(v)) else None for k, v in metrics.items()}  # NaN: null
            self.file.write(json.dumps({"step": step, "data": data}, allow_nan=False) + "\n")
            self.file.flush()
        if self.console and console:
            keys = console_keys or sorted(metrics)
            from tqdm import tqdm  # writes above an active progress bar instead of through it

            tqdm.write(f"step:{step} - " + " - ".join(f"{k}:{metrics[k]:.4g}" for k in keys if k in metrics),
                       file=sys.stdout)

    def log_generations(self, samples, step: int) -> None:
        """verl's validation samples, (prompt, response, score) each: a markdown text on TensorBoard
        (val/generations) and a W&B table with a row per validation (step, input_i, output_i, score_i)."""
        if not self.enabled or not samples:
            return
        if self.tb is not None:
            text = f"**Generation Results - Step {step}**\n\n" + "".join(
                f"### Sample {i + 1}\n**Input:** {p}\n\n**Output:** {r}\n\n**Score:** {s}\n\n"
                for i, (p, r, s) in enumerate(samples))
            self.tb.add_text("val/generations", text, step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            columns = ["step"] + [f"{k}_{i + 1}" for i in range(len(samples)) for k in ("input", "output", "score")]
            self._generations.append([step] + [x for s in samples for x in s])
            self.wandb.log({"val/generations": wandb.Table(columns=columns, data=self._generations), STEP_KEY: step})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
