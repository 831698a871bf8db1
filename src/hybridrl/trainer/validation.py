"""Validation metrics as verl 0.9.1 reports them (`metric_utils.process_validation_metrics`).

Each response carries values ("reward": its score after shaping, plus the reward's numeric extras
such as "acc"; a string "pred" is the extracted answer used for majority votes). Per data source,
per prompt (uid) and per value: mean@N and std@N over the prompt's N responses; for every
k in 2, 4, 8, ... < N and N: best@k / worst@k (max / min of k responses drawn with replacement) and,
when every response has a "pred", maj@k (the value of the first response holding the most common
answer among the k), each as the mean and std over 1000 bootstrap draws (numpy's legacy RNG seeded
42 for every prompt, as verl). Prompts are then averaged. The names are
`val-core/<data_source>/<var>/<metric>` for the core value ("acc" when present, else "reward") and
its mean@N, best@N and maj@N at the largest N, `val-aux/...` for everything else.
Pure functions on python lists: no torch.distributed, no I/O.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

N_BOOTSTRAP = 1000
SEED = 42


def _subset_sizes(n: int) -> List[int]:
    """2, 4, 8, ... below n, then n itself (none for a single response)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def bootstrap_indices(n_data: int, subset_size: int, seed: int = SEED) -> np.ndarray:
    """[N_BOOTSTRAP, subset_size] draws with replacement, the stream verl's bootstrap_metric uses."""
    return np.random.RandomState(seed).choice(n_data, size=(N_BOOTSTRAP, subset_size), replace=True)


def _mean_std(samples: np.ndarray) -> Tuple[float, float]:
    return float(np.mean(samples)), float(np.std(samples))


def _majority_values(values: Sequence[float], preds: Sequence[str], idx: np.ndarray) -> np.ndarray:
    """Per bootstrap draw: the value of the first response with the most common pred (ties: first seen)."""
    out = np.empty(idx.shape[0], dtype=np.float64)
    for b, draw in enumerate(idx):
        counts: Dict[str, int] = {}
        first: Dict[str, float] = {}
        for i in draw:
            p = preds[i]
            if p not in counts:
                counts[p], first[p] = 0, values[i]
            counts[p] += 1
        out[b] = first[max(counts, key=counts.get)]
    return out


def prompt_metrics(values: List[float], preds: List[Any] | None) -> Dict[str, float]:
    """mean@N, std@N, best@k, worst@k, maj@k of one prompt's N values."""
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    data = np.asarray(values, dtype=np.float64)
    has_pred = preds is not None and len(preds) == n and all(p is not None for p in preds)
    for k in _subset_sizes(n):
        idx = bootstrap_indices(n, k)
        drawn = data[idx]
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = _mean_std(drawn.max(axis=1))
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = _mean_std(drawn.min(axis=1))
        if has_pred:
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = _mean_std(_majority_values(values, preds, idx))
    return out


def process_validation_metrics(data_sources: Sequence[str], uids: Sequence[Any],
                               infos: Dict[str, Sequence[Any]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """{data_source: {var: {metric: mean over prompts}}} of per-response values `infos[var][i]`."""
    by_prompt: Dict[str, Dict[Any, Dict[str, list]]] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        per_var = by_prompt.setdefault(source, {}).setdefault(uid, {})
        for var, vals in infos.items():
            per_var.setdefault(var, []).append(vals[i])
    result: Dict[str, Dict[str, Dict[str, float]]] = {}
    for source, prompts in by_prompt.items():
        collected: Dict[str, Dict[str, list]] = {}
        for per_var in prompts.values():
            preds = per_var.get("pred")
            for var, vals in per_var.items():
                vals = [v for v in vals if v is not None]
                if not vals or isinstance(vals[0], str):
                    continue
                for metric, value in prompt_metrics(vals, preds).items():
                    collected.setdefault(var, {}).setdefault(metric, []).append(value)
        result[source] = {var: {m: float(np.mean(v)) for m, v in metrics.items()}
                          for var, metrics in collected.items()}
    return result


def validation_metric_dict(data_sources: Sequence[str], uids: Sequence[Any],
                           infos: Dict[str, Sequence[Any]]) -> Dict[str, float]:
    """verl's flat names: val-core/<source>/<var>/<metric> for the headline values, val-aux/... else."""
    out = {}
    for source, per_var in process_validation_metrics(data_sources, uids, infos).items():
        core_var = "acc" if "acc" in per_var else "reward"
        for var, metrics in per_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for metric, value in metrics.items():
                core = (var == core_var and metric.startswith(("mean", "maj", "best"))
                        and f"@{n_max}" in metric)
                out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{metric}"] = value
    return out


def metrics_from_samples(samples: Sequence[Tuple[str, Any, Dict[str, Any]]]) -> Dict[str, float]:
    """validation_metric_dict of (data_source, prompt uid, {var: value}) per response."""
    keys = list(dict.fromkeys(k for _, _, values in samples for k in values))
    infos = {k: [values.get(k) for _, _, values in samples] for k in keys}
    return validation_metric_dict([s for s, _, _ in samples], [u for _, u, _ in samples], infos)
