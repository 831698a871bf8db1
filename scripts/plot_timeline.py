"""Draw Chrome-trace timelines (hybridrl.timeline's files) one above the other into a PNG.

    python scripts/plot_timeline.py colocated.json split.json -o timeline.png [--width 1400] [--height 500]

One horizontal track per rank, one colour per phase name (waits in grey), nested spans drawn thinner
on top of their parent, one time axis shared by all files, a legend, and a title per file with its
wall time, each role's busy share and, when it holds several roles, their overlap. Draws with
matplotlib when it is installed, else Pillow, else a built-in PNG writer, so a fresh clone can run it.
Bad input ends in one `error: ...` line and exit code 2.
"""
from __future__ import annotations

import argparse
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hybridrl.log import UsageError, run_cli  # noqa: E402
from hybridrl.timeline import WAIT_PREFIX, busy_share, overlap, read_trace, role_groups  # noqa: E402

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (188, 189, 34), (23, 190, 207), (174, 199, 232), (255, 187, 120), (152, 223, 138)]
GREYS = [(190, 190, 190), (160, 160, 160), (215, 215, 215), (135, 135, 135)]
INK, FAINT, TRACK_BG = (30, 30, 30), (120, 120, 120), (244, 244, 244)
PAD, ROW_H = 8, 28


@dataclass
class Panel:
    """One trace file: tracks [(tid, label)], spans [(tid, name, start_s, end_s, depth)] from its first span."""
    title: str
    tracks: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    duration_s: float = 0.0


def _depths(spans):
    """Nesting depth of each (start, end) on one track (spans sorted by start, outer first)."""
    open_ends, out = [], []
    for start, end in spans:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        out.append(len(open_ends))
        open_ends.append(end)
    return out


TRACE_FIX = "pass the timeline.json a run writes under trainer.timeline_dir"


def load_panel(path: str) -> Panel:
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file; {TRACE_FIX}")
    try:
        events = read_trace(path)
        spans = [e for e in events if e.get("ph") == "X"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # not JSON, or not a list of event objects
        raise UsageError(f"{path} is not a Chrome-trace JSON file ({type(err).__name__}: {err}); {TRACE_FIX}") from None
    if not spans:
        raise UsageError(f"{path}: no complete ('X') events to draw; {TRACE_FIX}")
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    window = (min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans))  # microseconds
    t0, duration_s = window[0], (window[1] - window[0]) / 1e6
    title = f"{os.path.basename(path)}: {duration_s:.3g} s"
    groups = role_groups(spans)
    title += "".join(f", {role or 'busy'} {busy_share(spans, ranks, window):.0%}"
                     for role, ranks in sorted(groups.items()))
    if len(groups) > 1:
        title += f", overlap {overlap(spans, groups, window):.0%}"
    panel = Panel(title, duration_s=duration_s)
    for tid in sorted({e["tid"] for e in spans}):
        panel.tracks.append((tid, names.get(tid, f"rank {tid}")))
        mine = sorted((((e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6, e["name"]) for e in spans
                       if e["tid"] == tid), key=lambda s: (s[0], -s[1]))  # outer spans before inner ones
        for (s, e, name), depth in zip(mine, _depths([(s, e) for s, e, _ in mine])):
            panel.spans.append((tid, name, s, e, depth))
    return panel


def colours_for(panels):
    names = sorted({s[1] for p in panels for s in p.spans})
    work = [n for n in names if not n.startswith(WAIT_PREFIX)]
    waits = [n for n in names if n.startswith(WAIT_PREFIX)]
    out = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(work)}
    out.update({n: GREYS[i % len(GREYS)] for i, n in enumerate(waits)})
    return out


def _nice_step(span_s: float, target: int = 8) -> float:
    raw = span_s / target
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _legend_rows(colours, canvas_cls, width):
    rows, row, x = [], [], PAD
    for name in colours:
        w = canvas_cls.LINE_H + canvas_cls.text_width(name) + 3 * PAD
        if row and x + w > width - PAD:
            rows.append(row)
            row, x = [], PAD
        row.append((x, name))
        x += w
    return rows + [row]


def _fixed_height(panels, legend_rows, line_h):
    return len(panels) * (2 * line_h + 2 * PAD) + len(legend_rows) * line_h + 2 * PAD


def draw(canvas, panels, colours, legend_rows) -> None:
    lh = canvas.LINE_H
    n_tracks = sum(len(p.tracks) for p in panels)
    row_h = max(3, (canvas.height - _fixed_height(panels, legend_rows, lh)) // n_tracks)
    label_w = min(canvas.width // 3, max(canvas.text_width(lbl) for p in panels for _, lbl in p.tracks) + 2 * PAD)
    x0, x1 = label_w, canvas.width - PAD
    span_s = max(p.duration_s for p in panels) or 1.0
    step = _nice_step(span_s)

    def px(t):
        return x0 + int(round((x1 - x0) * t / span_s))

    y = PAD
    for panel in panels:
        canvas.text(PAD, y, panel.title, INK)
        y += lh + PAD // 2
        rows = {tid: y + i * row_h for i, (tid, _) in enumerate(panel.tracks)}
        for tid, label in panel.tracks:
            canvas.text(PAD, rows[tid] + (row_h - lh) // 2, label, INK)
            canvas.rect(x0, rows[tid] + 1, x1, rows[tid] + row_h - 1, TRACK_BG)
        for tid, name, s, e, depth in sorted(panel.spans, key=lambda sp: sp[4]):
            inset = 1 + min(depth * max(1, row_h // 6), row_h // 3)
            a, b = px(s), px(e)
            canvas.rect(a, rows[tid] + inset, max(b, a + 1), rows[tid] + row_h - inset, colours[name])
        y += len(panel.tracks) * row_h
        canvas.rect(x0, y, x1, y + 1, FAINT)
        for k in range(int(span_s / step) + 1):
            label = f"{k * step:g}s" if k else "0"
            canvas.rect(px(k * step), y, px(k * step) + 1, y + PAD // 2, FAINT)
            if px(k * step) + 2 + canvas.text_width(label) <= canvas.width:
                canvas.text(px(k * step) + 2, y + 2, label, FAINT)
        y += lh + PAD + PAD // 2
    for row in legend_rows:
        for x, name in row:
            canvas.rect(x, y + 2, x + lh - 4, y + lh - 2, colours[name])
            canvas.text(x + lh, y, name, INK)
        y += lh


# Canvases: rect(x0, y0, x1, y1, rgb) fills [x0, x1) x [y0, y1); text(x, y, s, rgb) has its top at y.

_FONT_ROWS = ("AEHHVHHH BUHHUHHU CEHGGGHE DSIHHHIS EVGGUGGV FVGGUGGG GEHGNHHF HHHHVHHH IE44444E J72222IC KHIKOKIH "
              "LGGGGGGV MHRLLHHH NHHPLJHH OEHHHHHE PUHHUGGG QEHHHLID RUHHUKIH SFGGE11U TV444444 UHHHHHHE VHHHHHA4 "
              "WHHHLLLA XHHA4AHH YHHHA444 ZV1248GV 0EHJLPHE 14C4444E 2EH1248V 3V2421HE 426AIV22 5VGU11HE 668GUHHE "
              "7V124888 8EHHEHHE 9EHHF12C _000000V -000V000 .00000CC (2488842 )8422248 :0CC0CC0 /01248G0 %OP248J3 "
              ",0000C48 =00V0V00 +044V440")
FONT = {g[0]: [int(c, 32) for c in g[1:]] for g in _FONT_ROWS.split()}
"""5x7 glyphs, one 5-bit row each (top first, bit 4 leftmost); lower case draws as upper case."""


class RawCanvas:
    """An RGB byte buffer written as a PNG with zlib and struct only; text in the 5x7 font at scale 2."""
    SCALE = 2
    LINE_H = 9 * SCALE

    def __init__(self, width, height):
        self.width, self.height = width, height
        self.buf = bytearray(b"\xff" * (width * height * 3))

    @classmethod
    def text_width(cls, s):
        return len(s) * 6 * cls.SCALE

    def rect(self, x0, y0, x1, y1, rgb):
        x0, x1 = max(0, int(x0)), min(self.width, int(x1))
        y0, y1 = max(0, int(y0)), min(self.height, int(y1))
        if x1 <= x0:
            return
        row = bytes(rgb) * (x1 - x0)
        for y in range(y0, y1):
            at = (y * self.width + x0) * 3
            self.buf[at:at + len(row)] = row

    def text(self, x, y, s, rgb):
        sc = self.SCALE
        for i, ch in enumerate(s.upper()):
            for r, bits in enumerate(FONT.get(ch, ())):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        left, top = x + (6 * i + c) * sc, y + (r + 1) * sc
                        self.rect(left, top, left + sc, top + sc, rgb)

    def save(self, path):
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.buf[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
                    + chunk(b"IEND", b""))


class PillowCanvas:
    LINE_H = 18
    _font = None

    def __init__(self, width, height):
        from PIL import Image, ImageDraw

        self.width, self.height = width, height
        self.image = Image.new("RGB", (width, height), "white")
        self.draw = ImageDraw.Draw(self.image)

    @classmethod
    def font(cls):
        if cls._font is None:
            from PIL import ImageFont

            try:
                cls._font = ImageFont.load_default(size=13)  # scalable with FreeType (Pillow >= 10.1)
            except (TypeError, ImportError, OSError):
                cls._font = ImageFont.load_default()
        return cls._font

    @classmethod
    def text_width(cls, s):
        return int(math.ceil(cls.font().getlength(s)))

    def rect(self, x0, y0, x1, y1, rgb):
        if x1 > x0 and y1 > y0:
            self.draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=tuple(rgb))

    def text(self, x, y, s, rgb):
        self.draw.text((x, y + 2), s, fill=tuple(rgb), font=self.font())

    def save(self, path):
        self.image.save(path, format="PNG")


class MatplotlibCanvas:
    """Pixel coordinates on one axes filling a width x height figure at 100 dpi."""
    LINE_H = 18

    def __init__(self, width, height):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.width, self.height = width, height
        self.figure = plt.figure(figsize=(width / 100, height / 100), dpi=100)
        self.axes = self.figure.add_axes((0, 0, 1, 1))
        self.axes.set_xlim(0, width)
        self.axes.set_ylim(height, 0)
        self.axes.axis("off")

    @classmethod
    def text_width(cls, s):
        return 7 * len(s)  # DejaVu Sans at 9 pt, 100 dpi

    def rect(self, x0, y0, x1, y1, rgb):
        from matplotlib.patches import Rectangle

        self.axes.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=[c / 255 for c in rgb], linewidth=0))

    def text(self, x, y, s, rgb):
        self.axes.text(x, y + 2, s, color=[c / 255 for c in rgb], fontsize=9, va="top", ha="left")

    def save(self, path):
        import matplotlib.pyplot as plt

        self.figure.savefig(path, dpi=100, format="png")
        plt.close(self.figure)


BACKENDS = {"matplotlib": MatplotlibCanvas, "pillow": PillowCanvas, "png": RawCanvas}
_MODULE = {"matplotlib": "matplotlib", "pillow": "PIL", "png": "zlib"}


def pick_backend(name: str):
    import importlib.util

    if name != "auto":
        return BACKENDS[name]
    return next(BACKENDS[n] for n in BACKENDS if importlib.util.find_spec(_MODULE[n]) is not None)


def plot(paths, output, width=1200, height=None, backend="auto") -> str:
    """Draw the trace files into `output` (width x height pixels; the height fits the tracks if None)."""
    canvas_cls = pick_backend(backend)
    panels = [load_panel(p) for p in paths]
    colours = colours_for(panels)
    legend = _legend_rows(colours, canvas_cls, width)
    n_tracks = sum(len(p.tracks) for p in panels)
    height = height or _fixed_height(panels, legend, canvas_cls.LINE_H) + n_tracks * ROW_H
    canvas = canvas_cls(width, height)
    draw(canvas, panels, colours, legend)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    canvas.save(output)
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="Chrome-trace JSON files, drawn top to bottom")
    parser.add_argument("-o", "--output", default="timeline.png")
    parser.add_argument("--width", type=int, default=1200, help="image width in pixels")
    parser.add_argument("--height", type=int, default=None, help="image height in pixels (default: fit the tracks)")
    parser.add_argument("--backend", choices=["auto", *BACKENDS], default="auto",
                        help="auto: matplotlib, else Pillow, else the built-in PNG writer")
    args = parser.parse_args(argv)
    return run_cli(lambda: print(plot(args.traces, args.output, args.width, args.height, args.backend)))


if __name__ == "__main__":
    sys.exit(main())
