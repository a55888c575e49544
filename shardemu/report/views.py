"""Views of a timeline: a Chrome / Perfetto trace and a lane plot.

`trace.json` follows the Trace Event Format (Google, "Trace Event Format", the JSON that
chrome://tracing and ui.perfetto.dev open): one process per pipeline stage (the device
role: every device of a stage does the same work), one thread per stream, a complete
event ("ph": "X", times in microseconds) per ledger event with its phase, bytes and FLOPs
in `args`. `timeline.png` draws the same lanes with phases coloured by kind, like the
source material's phased-execution heat maps.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import orjson

from shardemu.predict.costmodel import Timeline
from shardemu.predict.rows import SearchResult, SearchRow

log = logging.getLogger("shardemu")

_STREAM_ORDER = ("compute", "h2d", "d2h", "host")
_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "update": "#55a868",
    "embed": "#8c8c8c",
    "head": "#8172b3",
    "shared": "#937860",
    "embed-backward": "#c44e52",
    "shared-backward": "#da8bc3",
}


_WIDTH_INCHES, _DPI = 12, 110  # timeline.png: 1,320 pixels wide
# a lane's height: 0.35 in while the lanes fit in 40 in (4,400 pixels), then less, down
# to the 0.12 in a 7-point label needs (a 64-stage pipeline's 256 lanes took 10,032
# pixels at 0.35, 2.7 s to draw)
_LANE_INCHES, _LANES_INCHES, _LEAST_LANE_INCHES = 0.35, 40.0, 0.12


def lanes(timeline: Timeline) -> list[tuple[int, str]]:
    """(stage, stream) pairs in display order: stages in order, compute first."""

    def key(lane: tuple[int, str]) -> tuple:
        stage, stream = lane
        rank = _STREAM_ORDER.index(stream) if stream in _STREAM_ORDER else len(_STREAM_ORDER)
        return stage, rank, stream

    return sorted({(s.stage, s.stream) for s in timeline.spans}, key=key)


def trace_events(timeline: Timeline) -> list[dict]:
    order = {lane: i for i, lane in enumerate(lanes(timeline))}
    events: list[dict] = []
    for (stage, stream), tid in order.items():
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "ts": 0,
                "dur": 0,
                "pid": stage,
                "tid": tid,
                "args": {"name": stream},
            }
        )
    for stage in sorted({s for s, _ in order}):
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "ts": 0,
                "dur": 0,
                "pid": stage,
                "tid": 0,
                "args": {"name": f"stage {stage}"},
            }
        )
    # a phase's name, by its object: spans share their phases (a 1T step's 131k spans,
    # a few thousand phases), and naming one is Python code
    phases: dict[int, str] = {}
    for span in timeline.spans:
        duration = span.end - span.start
        if duration <= 0:
            continue
        e = span.event
        phase = phases.get(id(span.phase))
        if phase is None:
            phase = phases[id(span.phase)] = str(span.phase)
        events.append(
            {
                "name": f"{phase} {e.op or e.carries or e.kind}".strip(),
                "cat": e.kind,
                "ph": "X",
                "ts": span.start * 1e6,
                "dur": duration * 1e6,
                "pid": span.stage,
                "tid": order[(span.stage, span.stream)],
                "args": {
                    "phase": phase,
                    "bytes": e.bytes,
                    "flops": e.flops,
                    "carries": e.carries,
                    "axis": e.axis,
                    "op": e.op,
                },
            }
        )
    return events


def write_trace(timeline: Timeline, path: str | Path) -> Path:
    """trace.json, written by orjson: the standard library's JSON encoder took 0.5 s of
    a 128k-span trace, orjson 0.05 s, the same JSON."""
    path = Path(path)
    payload = {"traceEvents": trace_events(timeline), "displayTimeUnit": "ms"}
    path.write_bytes(orjson.dumps(payload) + b"\n")
    return path


def merged_bars(timeline: Timeline) -> dict[tuple[int, str, str], list[tuple[float, float]]]:
    """The spans as bars, per (stage, stream, phase kind): (start, end) in seconds, with
    spans that touch or overlap merged into one bar (a pipeline's back-to-back
    microbatches become one). What `plot_timeline` paints; sorting makes it n log n in
    the spans."""
    import numpy as np

    by_lane: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for span in timeline.spans:
        if span.end > span.start:
            key = (span.stage, span.stream, span.phase.kind)
            bars = by_lane.get(key)
            if bars is None:
                bars = by_lane[key] = []
            bars.append((span.start, span.end))
    touch = 1e-9 * max(timeline.step_time_s, 1e-30)  # float noise
    return {
        lane: [(a, b) for a, b in _merge(np.asarray(spans), touch).tolist()]
        for lane, spans in by_lane.items()
    }


def _merge(spans: Any, touch: float) -> Any:
    """(start, end) rows merged where one starts within `touch` of the furthest end
    before it, in start order: an (n, 2) array of bars separated by gaps."""
    import numpy as np

    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    reach = np.maximum.accumulate(spans[:, 1])  # the furthest end so far
    first = np.flatnonzero(np.r_[True, spans[1:, 0] > reach[:-1] + touch])
    last = np.r_[first[1:] - 1, len(spans) - 1]
    return np.stack([spans[first, 0], reach[last]], axis=1)


def bar_columns(bars: list[tuple[float, float]], step: float, columns: int) -> Any:
    """Which of `columns` equal columns across a step of `step` seconds the (start, end)
    bars touch: each bar the columns from its start's through its end's, one at least,
    so that none vanishes however short."""
    import numpy as np

    at = np.asarray(bars, dtype=float).reshape(-1, 2) * (columns / (step or 1.0))
    first = np.clip(np.floor(at[:, 0]).astype(int), 0, columns - 1)
    last = np.clip(np.floor(at[:, 1]).astype(int), first, columns - 1)
    edges = np.zeros(columns + 1, np.int64)  # +1 where a bar starts, -1 past its end
    np.add.at(edges, first, 1)
    np.add.at(edges, last + 1, -1)
    return np.cumsum(edges[:-1]) > 0


_LABELLED_LANES = 64  # past this, a label a stage (`label_lanes`)


def label_lanes(ax: Any, rows: list[tuple[int, str]]) -> None:
    """A label a lane; past `_LABELLED_LANES` lanes whose stages all have the same
    streams, a label a stage (at its first lane) and their order in the axis label:
    the 1T plan's 256 lane labels took 1.1 s of its picture's 1.7 s to lay out and
    draw, 64 stage labels about a quarter of that."""
    streams: dict[int, list[str]] = {}
    for stage, stream in rows:
        streams.setdefault(stage, []).append(stream)
    orders = {tuple(order) for order in streams.values()}
    if len(rows) <= _LABELLED_LANES or len(orders) != 1:
        ax.set_yticks(range(len(rows)), [f"stage {s} {stream}" for s, stream in rows], fontsize=7)
        return
    (order,) = orders
    firsts = range(0, len(rows), len(order))
    ax.set_yticks(firsts, [f"stage {rows[i][0]}" for i in firsts], fontsize=7)
    ax.set_ylabel(f"each stage's lanes, top to bottom: {', '.join(order)}", fontsize=7)


def plot_timeline(timeline: Timeline, path: str | Path, title: str) -> Path:
    """One lane per (stage, stream), bars coloured by phase kind (a later kind over an
    earlier one where they share a pixel column). The axes, labels and legend are drawn
    by matplotlib; the bars are painted into its pixels (`bar_columns`), inside the
    axes and around the legend: a 64-stage pipeline's 256 lanes took 1.9 s to draw as
    60k rectangles, twice (layout, then save). A figure of its own, not pyplot's: no
    GUI backend or figure manager to start."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgba_array
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from PIL import Image

    rows = lanes(timeline)
    lane = max(_LEAST_LANE_INCHES, min(_LANE_INCHES, _LANES_INCHES / max(len(rows), 1)))
    fig = Figure(figsize=(_WIDTH_INCHES, lane * len(rows) + 1.6), dpi=_DPI)
    canvas, ax = FigureCanvasAgg(fig), fig.subplots()
    bars = merged_bars(timeline)
    kinds = {kind: _COLOURS.get(kind, "#cccccc") for _, _, kind in bars}
    ax.set_xlim(0, timeline.step_time_s * 1e3 or 1)
    ax.set_ylim(len(rows) - 0.4, -0.6)  # stage 0 on top
    label_lanes(ax, rows)
    ax.set_xlabel("time in step (ms)")
    ax.ticklabel_format(axis="x", style="plain")
    ax.set_title(title, fontsize=9)
    legend = ax.legend(
        handles=[Patch(color=c, label=k) for k, c in kinds.items()],
        fontsize=7,
        loc="upper right",
        ncols=min(len(kinds), 8),
    )
    fig.tight_layout()
    canvas.draw()
    image = np.array(canvas.buffer_rgba())  # row 0 on top; display y from the bottom
    height = image.shape[0]
    box, key = ax.get_window_extent(), legend.get_window_extent()
    left, right = int(np.ceil(box.x0)) + 1, int(np.floor(box.x1)) - 1  # inside the spines
    free = np.ones(image.shape[:2], bool)  # where a bar may be painted: not the legend
    free[
        height - int(np.ceil(key.y1)) : height - int(key.y0), int(key.x0) : int(np.ceil(key.x1))
    ] = False
    index = {lane: i for i, lane in enumerate(rows)}
    for (stage, stream, kind), spans in bars.items():
        i = index[(stage, stream)]
        ys = ax.transData.transform([(0, i - 0.4), (0, i + 0.4)])[:, 1]
        top, bottom = height - int(round(ys.max())), height - int(round(ys.min()))
        covered = bar_columns(spans, timeline.step_time_s, right - left)
        paint = free[top : max(bottom, top + 1), left:right] & covered
        image[top : max(bottom, top + 1), left:right][paint] = np.round(
            to_rgba_array(kinds[kind])[0] * 255
        ).astype(np.uint8)
    Image.fromarray(image).save(path, dpi=(_DPI, _DPI))
    return Path(path)


def save_figure(fig: Any, path: Path, copy_to: Path | None = None) -> Path:
    """Lay out, save and close a matplotlib figure; with `copy_to`, also copy the file
    into that folder (the experiments publish their plots to docs/figures/)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    # laid out once: with tight_layout's placeholder engine left in place, savefig
    # would draw the whole figure a second time before saving it
    fig.set_layout_engine(None)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy_to / path.name)
    return path


MAX_TRACE_SPANS = 200_000  # a trace past this is too big for a browser to open


def write_views(timeline: Timeline, out: Path, title: str) -> dict[str, str]:
    """timeline.png (always: its bars are merged) and trace.json in `out`; their paths,
    by the report keys `timeline` and `trace`. A timeline of more than MAX_TRACE_SPANS
    spans, too many for a browser, gets the trace of its critical stage alone (the
    first MAX_TRACE_SPANS of them at most), and `trace_window` says so."""
    views = {"timeline": str(plot_timeline(timeline, out / "timeline.png", title))}
    spans = timeline.spans
    if len(spans) > MAX_TRACE_SPANS:
        stage = timeline.critical_stage
        kept = [s for s in spans if s.stage == stage][:MAX_TRACE_SPANS]
        views["trace_window"] = (
            f"the critical stage {stage} alone: {len(kept):,} of the step's {len(spans):,} "
            f"spans (a whole trace past {MAX_TRACE_SPANS:,} is too large for a browser)"
        )
        log.warning("trace.json holds %s", views["trace_window"])
        timeline = dataclasses.replace(timeline, spans=kept)
    views["trace"] = str(write_trace(timeline, out / "trace.json"))
    return views


def plot_pareto(result: SearchResult, path: Path) -> Path:
    """`shardemu search`'s pareto.png: every fitting layout's device memory against its
    predicted step time, the Pareto front joined, the best `top` ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def gb(rows: list[SearchRow]) -> list[float]:
        return [(r.device_bytes or 0) / 1e9 for r in rows]

    fig, ax = plt.subplots(figsize=(8, 5))
    for mode, marker in (("resident", "o"), ("phased", "s")):
        rows = [r for r in result.candidates if r.fits and r.mode == mode]
        if rows:
            ax.scatter(
                gb(rows),
                [r.step_time_s for r in rows],
                s=12,
                marker=marker,
                alpha=0.5,
                label=f"{mode} ({len(rows)})",
            )
    front = result.pareto
    ax.plot(
        gb(front),
        [r.step_time_s for r in front],
        "k-",
        lw=1,
        drawstyle="steps-post",
        label="Pareto front",
    )
    top = list(result.top)
    ax.scatter(
        gb(top),
        [r.step_time_s for r in top],
        s=60,
        facecolors="none",
        edgecolors="red",
        label=f"top {len(top)}",
    )
    best = result.best
    ax.annotate(
        best.label,
        (gb([best])[0], best.step_time_s),
        fontsize=7,
        xytext=(-5, 5),
        textcoords="offset points",
        ha="right",
    )
    ax.set(
        xlabel="device memory per device (GB)",
        ylabel="predicted step time (s)",
        title=f"{result.model} on {result.devices} x {result.hardware}, "
        f"batch {result.batch} x {result.seq}",
    )
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
