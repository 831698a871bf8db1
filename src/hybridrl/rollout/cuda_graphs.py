"""CUDA graphs of the decode step, one per batch-size bucket (as vLLM and megatron-core capture them).

A step over n active slots runs the graph of the smallest bucket b >= n; slots n..b-1 are parked
(scratch output row, position 0), so the padded rows compute harmlessly. Following the
torch.cuda.CUDAGraph recipe: the step reads and writes only buffers allocated before capture
(the KV cache, the slot state, the output rows), each bucket is warmed up on a side stream before its
capture, all buckets share one memory pool (replays never overlap, and each graph's outputs are read
before the next replay), and a replay is the whole step. Buckets are captured when first needed,
largest first in practice (a call starts full and drains), and live as long as the generate call
that owns the buffers.

`capture=False` runs the same padded bucket steps eagerly: the CPU check of the bucket logic.
"""
from __future__ import annotations

from typing import Callable

import torch


def bucket_sizes(max_slots: int) -> list[int]:
    """Powers of two below max_slots, then max_slots: at most log2(max_slots) + 1 graphs."""
    sizes, b = [], 1
    while b < max_slots:
        sizes.append(b)
        b *= 2
    return sizes + [max_slots]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds n rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")


class DecodeGraphs:
    """step(b) -> output tensors, run as a captured CUDA graph per bucket b."""

    def __init__(self, step: Callable[[int], tuple], max_slots: int, capture: bool = True, warmup: int = 2):
        self.step, self.buckets, self.capture, self.warmup = step, bucket_sizes(max_slots), capture, warmup
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple] = {}
        self.pool = None

    def __call__(self, n: int) -> tuple:
        """Outputs of the bucket's step for slots [0, bucket); rows n.. are padding."""
        b = bucket_for(n, self.buckets)
        if not self.capture:
            return self.step(b)
        if b not in self.graphs:
            self._capture(b)
        self.graphs[b].replay()
        return self.outputs[b]

    def _capture(self, b: int) -> None:
        # Warm-up and capture repeat the coming step exactly: its writes (keys/values at the rows'
        # positions, output rows) are the ones the replay makes again, so they change nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.step(b)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[b] = self.step(b)
        self.graphs[b] = graph
