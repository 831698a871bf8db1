"""Split placement's per-step figures: from the span timeline, how much of a step both roles compute at once
(`perf/overlap`) and how much of it each role computes nothing (`perf/idle/trainer`, `perf/idle/rollout`);
from the bridges, the bytes that crossed between roles (`perf/rows_bytes`, `perf/weight_sync_bytes`).

`perf/rows_bytes` of step k: the row tensors of step k's batch that the trainer ranks received from the
rollout leader (each rank its DP group's rows), plus the batch columns that a critic of its own received:
with B rows, critic DP d and c critic ranks, c * B / d rows of each column crossed (each critic rank the
rows of its critic DP group; TP/PP peers receive the same ones). `perf/weight_sync_bytes` of step k: the
bytes of update k's weights that the sending ranks (one per stage and EP rank) put on their weight bridges
(each rollout rank receives them once), 0 when none went out; `perf/weight_sync_sender_max_bytes` the most
one sender put on its bridge. At staleness 1 they leave during step k+1, so they are logged with the step's
late figures.

Compute is what `hybridrl.timeline.is_compute` says: waits (for rows, for the critic ranks, for a request)
and weight transfers are not. A step's window runs from its start to its end on the trainer rank; the
rollout ranks' spans of that window reach the trainers with later answers (at staleness 1 the generation
that overlapped step k comes back with step k+1's batch), so the figures of step k are known at the end of
step k+1, or after the rollout ranks' goodbye for the last step, and are logged under step k.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrl.timeline import Timeline, busy_share, overlap


def rollout_events(spans: list, role: str = "rollout") -> list:
    """Chrome-trace events of another role's (global rank, phase, start, end) spans (the rollout ranks' unless
    `role` says otherwise)."""
    tracks = {}
    for rank, name, start, end in spans:
        tracks.setdefault(rank, Timeline(rank, role)).add(name, start, end)
    return [e for tl in tracks.values() for e in tl.events()]


def window_shares(timeline: Timeline, rollout_spans: list, window: tuple) -> dict:
    """perf/overlap and perf/idle/* over `window` (start, end in seconds on the timeline's clock): shares of
    the window in which this trainer rank and some rollout rank both compute, this rank computes nothing,
    no rollout rank computes."""
    lo, hi = window
    mine = [e for e in timeline.events() if e["ph"] == "X" and (e["ts"] + e["dur"]) / 1e6 >= lo]
    theirs = [e for e in rollout_events([s for s in rollout_spans if s[3] >= lo]) if e["ph"] == "X"]
    ranks, us = {e["tid"] for e in theirs}, (lo * 1e6, hi * 1e6)
    trainer = busy_share(mine, [timeline.rank], us)
    rollout = busy_share(theirs, ranks, us) if ranks else 0.0
    both = overlap(mine + theirs, {"trainer": {timeline.rank}, "rollout": ranks}, us) if ranks else 0.0
    return {"perf/overlap": both, "perf/idle/trainer": 1.0 - trainer, "perf/idle/rollout": 1.0 - rollout}


class StepShares:
    """`window_shares` of each step, once its rollout spans are in: `ended(step, start, end)` after a step
    returns the previous step's, `finish()` (after the rollout ranks' goodbye) the last one's. Each step's
    window is marked on the timeline (`step <k>` at its start, `step <k> end` at its end); unless `keep`
    (a timeline written to a file) spans older than the open step are dropped."""

    def __init__(self, timeline: Timeline, client, keep: bool):
        self.timeline, self.client, self.keep = timeline, client, keep
        self.open = None
        """(step, (start, end)) whose figures wait for the rollout ranks' spans."""

    def ended(self, step: int, start: float, end: float) -> list:
        done = self.finish()
        self.open = (step, (start, end))
        self.timeline.mark(f"step {step}", start)
        self.timeline.mark(f"step {step} end", end)
        if not self.keep:
            self.timeline.trim(start)
            self.client.trim_spans(start)
        return done

    def finish(self) -> list:
        """[(step, figures)] of the open step (empty when none)."""
        if self.open is None:
            return []
        (step, window), self.open = self.open, None
        sent = self.client.sync_bytes.pop(step, {"perf/weight_sync_bytes": 0.0})
        return [(step, dict(window_shares(self.timeline, self.client.spans, window), **sent))]

    def rows_bytes(self, step: int, critic, device) -> dict:
        """perf/rows_bytes of `step` (collective over the trainer ranks)."""
        mine = self.client.rows_bytes.pop(step, 0) + getattr(critic, "rows_bytes", 0)
        self.client.rows_bytes = {k: v for k, v in self.client.rows_bytes.items() if k > step}
        if hasattr(critic, "rows_bytes"):
            critic.rows_bytes = 0
        total = torch.tensor([float(mine)], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return {"perf/rows_bytes": total.item()}
