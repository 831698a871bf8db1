"""Per-rank timeline of named phase spans, written as Chrome-trace JSON, and the overlap it shows.

`Timeline.span("gen")` records wall-clock spans on a clock anchored to the epoch, so ranks in different
processes (and nodes with synced clocks) share one time axis. `gather_and_write` collects every rank's
events into one Trace Event Format file that Perfetto, chrome://tracing and `scripts/plot_timeline.py`
open: one track per rank. `overlap` and `busy_share` measure from those events, by exact interval
arithmetic, how much of the wall time the roles (trainer, rollout) compute at the same time.

Must not import other hybridrl packages (`hybridrl.log` at most); only `gather_and_write` may touch
torch.distributed, and only when it is initialised.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

_NULL = contextlib.nullcontext()  # reusable: a disabled span costs one attribute test
WAIT_PREFIX = "wait"
"""Spans whose name starts with this are idle time, not compute (`wait_rollout`, `wait_critic`)."""
TRANSFER = frozenset({"update_weights"})
"""Spans that move weights between roles or into an engine: busy, but not compute; `busy_intervals` leaves
them out like waits (in split placement both roles sit in the same transfer, which is no overlap)."""


def is_compute(name: str) -> bool:
    return not name.startswith(WAIT_PREFIX) and name not in TRANSFER

Interval = Tuple[float, float]


class Timeline:
    """Spans `(name, start_s, end_s)` of one rank, in seconds since the epoch.

    `enabled` must agree across ranks: `gather_and_write` is collective only when it is on."""

    def __init__(self, rank: int, role: str, enabled: bool = True):
        self.rank, self.role, self.enabled = rank, role, enabled
        self.spans: List[Tuple[str, float, float]] = []
        self.marks: List[Tuple[str, float]] = []
        self._epoch0, self._pc0 = time.time(), time.perf_counter()

    def now(self) -> float:
        """This timeline's clock: the epoch at construction plus perf_counter's (monotonic) progress."""
        return self._epoch0 + (time.perf_counter() - self._pc0)

    def at(self, perf_counter_s: float) -> float:
        """A `time.perf_counter()` reading on this timeline's clock."""
        return self._epoch0 + (perf_counter_s - self._pc0)

    def span(self, name: str):
        """`with timeline.span("gen"):` records the block, also when it raises."""
        return self._span(name) if self.enabled else _NULL

    @contextlib.contextmanager
    def _span(self, name: str):
        start = self.now()
        try:
            yield
        finally:
            self.spans.append((name, start, self.now()))

    def add(self, name: str, start: float, end: float) -> None:
        """A span measured elsewhere, in seconds on this clock (`now()`) or `time.time()`."""
        if self.enabled:
            self.spans.append((name, float(start), float(end)))

    def mark(self, name: str, at: Optional[float] = None) -> None:
        """An instant event (a weight sync landing, a step's start), now or `at` (seconds on this clock)."""
        if self.enabled:
            self.marks.append((name, self.now() if at is None else float(at)))

    def clear(self) -> None:
        self.spans.clear()
        self.marks.clear()

    def take(self) -> List[Tuple[int, str, float, float]]:
        """The spans since the last take as (rank, phase, start, end), for another rank to place on this
        rank's track; the timeline is cleared."""
        spans = [(self.rank, *span) for span in self.spans]
        self.clear()
        return spans

    def trim(self, before: float) -> None:
        """Forget spans that ended and marks made before `before` (this clock's seconds): a run that keeps
        a timeline only to measure its latest step must not grow it step after step."""
        self.spans[:] = [s for s in self.spans if s[2] >= before]
        self.marks[:] = [m for m in self.marks if m[1] >= before]

    def events(self) -> List[dict]:
        """Trace Event Format: complete ("X") and instant ("i") events in microseconds, and the track's name."""
        if not self.enabled:
            return []
        base = {"pid": 0, "tid": self.rank}
        out = [{"ph": "M", "name": "thread_name", **base, "args": {"name": f"rank {self.rank} ({self.role})"}},
               {"ph": "M", "name": "thread_sort_index", **base, "args": {"sort_index": self.rank}}]
        out += [{"name": n, "ph": "X", "ts": s * 1e6, "dur": (e - s) * 1e6, **base, "cat": self.role}
                for n, s, e in self.spans]
        out += [{"name": n, "ph": "i", "s": "t", "ts": t * 1e6, **base, "cat": self.role} for n, t in self.marks]
        return out


def write_trace(path: str, events: Iterable[dict]) -> None:
    """`{"traceEvents": events, "displayTimeUnit": "ms"}`, written atomically (a reader never sees half)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".trace-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"traceEvents": list(events), "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read_trace(path: str) -> List[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data  # the format allows a bare array too


def gather_and_write(timeline: Timeline, path: str, group=None) -> List[dict]:
    """Collective over `group` (the world by default) when torch.distributed is initialised: every rank
    gets all ranks' events back and the group's first rank writes `path`. Without a process group the
    caller's own events are written. A disabled timeline writes nothing and returns []."""
    if not timeline.enabled:
        return []
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, timeline.events(), group=group)
        events = [e for rank_events in gathered for e in rank_events]
        if dist.get_rank(group) == 0:
            write_trace(path, events)
        return events
    events = timeline.events()
    write_trace(path, events)
    return events


# Interval arithmetic on sorted, disjoint lists of (start, end).

def _union(intervals: Iterable[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _intersect(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > s:
                out.append((s, b[k][0]))
            s, k = max(s, b[k][1]), k + 1
        if e > s:
            out.append((s, e))
    return out


def _length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def busy_intervals(events: Iterable[dict], rank: int) -> List[Interval]:
    """Where `rank` computes, in microseconds: inside a compute span and inside no wait or transfer span
    (so an umbrella `step` span around a `wait_rollout` leaves the wait out, a `gen` span the weights a
    partial rollout takes in on the way)."""
    spans = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e["tid"] == rank]
    idle = _union((s, e) for n, s, e in spans if not is_compute(n))
    return _subtract(_union((s, e) for n, s, e in spans if is_compute(n)), idle)


def _window(events: Sequence[dict], ranks: Set[int]) -> Interval:
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e["tid"] in ranks]
    if not spans:
        raise ValueError(f"no spans of ranks {sorted(ranks)} in the trace; pass window=(start_us, end_us)")
    return min(s for s, _ in spans), max(e for _, e in spans)


def _share(intervals: List[Interval], window: Interval) -> float:
    start, end = window
    return _length(_intersect(intervals, [window])) / (end - start) if end > start else 0.0


def overlap(events: Sequence[dict], groups: Dict[str, Set[int]], window: Optional[Interval] = None) -> float:
    """Share of the window during which every group (`{"trainer": {0}, "rollout": {1}}`) has at least one
    rank computing at once. `window` is (start_us, end_us); by default the groups' first span start to
    last span end."""
    events = list(events)
    ranks = set().union(*groups.values())
    window = window or _window(events, ranks)
    common: Optional[List[Interval]] = None
    for members in groups.values():
        busy = _union(i for r in members for i in busy_intervals(events, r))
        common = busy if common is None else _intersect(common, busy)
    return _share(common or [], window)


def busy_share(events: Sequence[dict], ranks: Iterable[int], window: Optional[Interval] = None) -> float:
    """Share of the window during which at least one of `ranks` computes."""
    events, ranks = list(events), set(ranks)
    window = window or _window(events, ranks)
    return _share(_union(i for r in ranks for i in busy_intervals(events, r)), window)


def role_groups(events: Iterable[dict]) -> Dict[str, Set[int]]:
    """`{role: ranks}` from the events' categories (each rank's role), for `overlap`."""
    groups: Dict[str, Set[int]] = {}
    for e in events:
        if e.get("ph") == "X":
            groups.setdefault(e.get("cat", ""), set()).add(e["tid"])
    return groups
