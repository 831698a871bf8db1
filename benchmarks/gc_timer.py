"""Garbage collection as a stage of its own in the TRL side scripts (runs in their side environments)."""
import gc
import time


def time_gc(sink: list) -> None:
    """Add the seconds of every garbage collection to sink[-1] (the current step's window)."""
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and sink:
            sink[-1] += time.perf_counter() - started[0]
    gc.callbacks.append(on_gc)
