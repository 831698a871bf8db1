"""hybridrl.timeline: Chrome-trace events, overlap by hand and against a unit-cell count, one file from two
gloo ranks, and scripts/plot_timeline.py's PNG."""
import importlib.util
import json
import os
import random
import struct
import subprocess
import sys
import time
import zlib

import pytest

from dist_helper import run_distributed
from hybridrl.timeline import Timeline, busy_share, gather_and_write, overlap, read_trace, write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_timeline.py")
T = 1000.0  # seconds on the epoch clock
GROUPS = {"trainer": {0}, "rollout": {1}}


def _us(*seconds):
    return tuple((T + s) * 1e6 for s in seconds)


def _split_trace():
    """Trainer computes [0, 4] and [6, 10] (an umbrella `step` holds its wait), rollout [2, 8]."""
    trainer = Timeline(0, "trainer", True)
    trainer.add("step", T, T + 10)
    trainer.add("update_actor", T, T + 4)
    trainer.add("wait_rollout", T + 4, T + 6)
    trainer.add("update_actor", T + 6, T + 10)
    rollout = Timeline(1, "rollout", True)
    rollout.add("gen", T + 2, T + 8)
    rollout.add("wait_weights", T + 8, T + 10)
    return trainer.events() + rollout.events()


def test_overlap_and_busy_share_by_hand():
    events = _split_trace()
    assert overlap(events, GROUPS) == pytest.approx(4 / 10)  # [2, 4] and [6, 8]
    assert overlap(events, GROUPS, window=_us(0, 20)) == pytest.approx(4 / 20)
    assert busy_share(events, [0]) == pytest.approx(8 / 10)
    assert busy_share(events, [1]) == pytest.approx(6 / 8)  # its own window: [2, 10]
    assert busy_share(events, [1], window=_us(0, 10)) == pytest.approx(6 / 10)
    assert busy_share(events, [0, 1]) == pytest.approx(10 / 10)
    # a second rollout rank generating in [8, 9] widens its group to [2, 9]: [2, 4] and [6, 9]
    extra = Timeline(2, "rollout", True)
    extra.add("gen", T + 8, T + 9)
    assert overlap(events + extra.events(), {"trainer": {0}, "rollout": {1, 2}}) == pytest.approx(5 / 10)
    # a group that only waits never overlaps
    assert overlap(events + extra.events(), {"trainer": {0}, "idle": {3}}, window=_us(0, 10)) == 0.0
    with pytest.raises(ValueError, match="window"):
        overlap(events, {"nobody": {7}})


def _busy_cells(spans, rank, n):
    """Reference: unit cell [t, t + 1) is busy when a compute span covers it and no wait span does."""
    def covered(t, wait):
        return any(r == rank and s <= t < e and name.startswith("wait") == wait for r, name, s, e in spans)
    return {t for t in range(n) if covered(t, False) and not covered(t, True)}


def test_overlap_matches_a_unit_cell_count_on_random_spans():
    rng, n = random.Random(0), 40
    for _ in range(20):
        spans = []
        for rank in range(4):
            for _ in range(rng.randint(0, 6)):
                s = rng.randrange(n)
                spans.append((rank, rng.choice(["gen", "update_actor", "wait_rollout"]), s, rng.randint(s, n)))
        timelines = {r: Timeline(r, "x", True) for r in range(4)}
        for rank, name, s, e in spans:
            timelines[rank].add(name, T + s, T + e)
        events = [e for tl in timelines.values() for e in tl.events()]
        groups = {"a": {0}, "b": {1, 2}, "c": {3}}
        cells = [set().union(*(_busy_cells(spans, r, n) for r in g)) for g in groups.values()]
        window = _us(0, n)
        assert overlap(events, groups, window) == pytest.approx(len(set.intersection(*cells)) / n, abs=1e-9)
        assert busy_share(events, [1, 2], window) == pytest.approx(len(cells[1]) / n, abs=1e-9)


def test_trace_is_valid_trace_event_format_and_round_trips(tmp_path):
    before = time.time()
    tl = Timeline(3, "rollout", True)
    with tl.span("gen"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), tl.span("boom"):
        raise RuntimeError
    tl.add("known", T, T + 0.25)
    tl.mark("weights_synced")
    after = time.time()
    path = tmp_path / "sub" / "trace.json"
    write_trace(str(path), tl.events())
    assert os.listdir(path.parent) == ["trace.json"]  # no temporary left behind
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms" and data["traceEvents"] == tl.events() == read_trace(str(path))
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in complete] == ["gen", "boom", "known"]
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["tid"] == 3 and e["cat"] == "rollout"
    gen = complete[0]  # microseconds since the epoch
    assert before * 1e6 <= gen["ts"] and gen["ts"] + gen["dur"] <= after * 1e6 and 1e4 <= gen["dur"] < 1e6
    assert (complete[2]["ts"], complete[2]["dur"]) == (T * 1e6, 0.25 * 1e6)
    meta = [e for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert meta == [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 3, "args": {"name": "rank 3 (rollout)"}}]
    assert [e["name"] for e in data["traceEvents"] if e["ph"] == "i"] == ["weights_synced"]


def test_disabled_timeline_records_nothing(tmp_path):
    tl = Timeline(0, "trainer", False)
    with tl.span("gen"):
        pass
    tl.add("gen", T, T + 1)
    tl.mark("sync")
    assert tl.spans == [] and tl.marks == [] and tl.events() == []
    assert gather_and_write(tl, str(tmp_path / "t.json")) == [] and not (tmp_path / "t.json").exists()


def test_trim_keeps_what_ends_in_the_window():
    """Split placement keeps a timeline only for the latest step's overlap: older spans and marks are dropped."""
    tl = Timeline(0, "trainer")
    for i in range(5):
        tl.add("gen", T + i, T + i + 1.5)
    tl.mark("sync")  # now: after the window's start
    tl.marks.insert(0, ("old", T))
    tl.trim(T + 4)
    assert tl.spans == [("gen", T + 3, T + 4.5), ("gen", T + 4, T + 5.5)] and [m[0] for m in tl.marks] == ["sync"]


def _record_and_gather(path):
    import torch.distributed as dist

    rank = dist.get_rank()
    tl = Timeline(rank, "trainer" if rank == 0 else "rollout", True)
    with tl.span("update_actor" if rank == 0 else "gen"):
        time.sleep(0.02)
    tl.add("known", T + rank, T + rank + 2)
    return gather_and_write(tl, path)


@pytest.mark.distributed
def test_gather_and_write_puts_both_ranks_in_one_file(tmp_path):
    path = str(tmp_path / "trace.json")
    before = time.time()
    per_rank = run_distributed(_record_and_gather, 2, path)
    after = time.time()
    events = read_trace(path)
    assert per_rank[0] == per_rank[1] == events  # every rank got all events back
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "rank 0 (trainer)", 1: "rank 1 (rollout)"}
    spans = {(e["tid"], e["name"]): e for e in events if e["ph"] == "X"}
    assert set(spans) == {(0, "update_actor"), (0, "known"), (1, "gen"), (1, "known")}
    for rank, name in [(0, "update_actor"), (1, "gen")]:  # both processes on the parent's clock
        assert before * 1e6 <= spans[rank, name]["ts"] <= after * 1e6
    # known spans [0, 2] and [1, 3]: both compute in [1, 2]
    known = [e for e in events if e["ph"] != "X" or e["name"] == "known"]
    assert overlap(known, GROUPS) == pytest.approx(1 / 3)


def _png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def plot_timeline():
    spec = importlib.util.spec_from_file_location("plot_timeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up while it is defined
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def two_traces(tmp_path):
    colocated = Timeline(0, "actor_rollout", True)
    for k in range(2):
        colocated.add("gen", T + 10 * k, T + 10 * k + 6)
        colocated.add("update_actor", T + 10 * k + 6, T + 10 * k + 10)
    paths = [str(tmp_path / "colocated.json"), str(tmp_path / "split.json")]
    write_trace(paths[0], colocated.events())
    write_trace(paths[1], _split_trace())
    return paths


def test_plot_script_writes_a_png_of_the_requested_size(two_traces, tmp_path):
    out = str(tmp_path / "timeline.png")
    subprocess.run([sys.executable, SCRIPT, *two_traces, "-o", out, "--width", "640", "--height", "240"],
                   check=True, capture_output=True)
    assert _png_size(out) == (640, 240)


def test_builtin_png_writer_draws_every_phase(plot_timeline, two_traces, tmp_path):
    out = plot_timeline.plot(two_traces, str(tmp_path / "raw.png"), width=500, height=200, backend="png")
    assert _png_size(out) == (500, 200)
    data = open(out, "rb").read()
    at, idat = 8, b""
    while at < len(data):  # walk the chunks, checking each CRC
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        idat += body if kind == b"IDAT" else b""
        at += 12 + length
    raw, stride = zlib.decompress(idat), 1 + 500 * 3
    rows = [raw[y * stride:(y + 1) * stride] for y in range(200)]
    assert len(raw) == 200 * stride and all(r[0] == 0 for r in rows)
    pixels = {r[1 + 3 * x:4 + 3 * x] for r in rows for x in range(500)}
    panels = [plot_timeline.load_panel(p) for p in two_traces]
    colours = plot_timeline.colours_for(panels)
    for name, rgb in colours.items():  # the legend alone paints these: the samples below find the bars
        assert bytes(rgb) in pixels, f"no {name} pixels"
    # the layout by hand, 500 x 200: 2 legend rows (gen, step, update_actor | wait_rollout, wait_weights) of 18 px,
    # so 200 - (2 panels x (2 x 18 + 2 x 8) + 2 x 18 + 2 x 8) = 44 px for 3 tracks of 14; the labels are wider than
    # a third of the width, so the time axis runs from x 166 to 492 over 20 s (the longer file). Track tops: panel 1
    # at 8 + 18 + 4 = 30, panel 2 at 30 + 14 + 18 + 8 + 4 + 18 + 4 = 96 and 110. A bar spans its track but a pixel at
    # top and bottom; a nested one (depth 1) 3 px
    def at(y, t):
        x = 166 + round(326 * t / 20)
        return tuple(rows[y][1 + 3 * x:4 + 3 * x])

    blank = plot_timeline.TRACK_BG
    samples = {(37, 3): "gen", (37, 8): "update_actor", (37, 13): "gen", (37, 18): "update_actor",  # colocated
               (103, 2): "update_actor", (103, 5): "wait_rollout", (103, 8): "update_actor", (97, 5): "step",
               (103, 15): blank, (117, 1): blank, (117, 5): "gen", (117, 9): "wait_weights", (117, 15): blank}
    for (y, t), want in samples.items():
        assert at(y, t) == tuple(colours.get(want, want)), (y, t, want, at(y, t))


def test_pillow_backend_fits_the_height_to_the_tracks(plot_timeline, two_traces, tmp_path):
    pytest.importorskip("PIL")
    out = plot_timeline.plot(two_traces, str(tmp_path / "pil.png"), width=700, backend="pillow")
    width, height = _png_size(out)
    assert width == 700 and height > 3 * plot_timeline.ROW_H  # three tracks and their titles
