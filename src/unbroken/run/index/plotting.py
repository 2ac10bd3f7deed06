"""Metric curves as PNG files: a run from its index (``unbroken plot``), or any curves (the demo).

Drawing uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global
state), imported only when a plot is drawn. Each curve gets its own colour; a *reference*
curve (the uninterrupted run of the demo) is drawn wide and light behind the others, so
an exact resume shows as coloured lines lying on a grey band. Markers show saves,
interruptions and resumes.
"""

from __future__ import annotations

import io
import itertools
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...store.dirfd import write_file_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .index import RunIndex

MarkerKind = Literal["save", "interruption", "resume"]
MARKERS: dict[str, dict[str, Any]] = {
    "save": {"marker": "o", "s": 22, "facecolors": "none", "edgecolors": "0.25", "label": "checkpoint saved"},
    "interruption": {"marker": "X", "s": 70, "color": "#d62728", "label": "interrupted"},
    "resume": {"marker": "^", "s": 60, "color": "black", "label": "resumed"},
}
LOG_SPAN = 100.0
"""Values spanning more than this factor get a logarithmic axis (unless told otherwise)."""
COLOURS = ("C0", "C1", "C2", "C4", "C5", "C6", "C8", "C9")
"""Curve colours: matplotlib's default cycle without red (interruptions) and grey (the reference)."""


@dataclass(frozen=True)
class Curve:
    """One line: a metric over steps."""

    label: str
    steps: Sequence[int]
    values: Sequence[float]
    reference: bool = False
    """Draw wide, light and behind the others (the curve the others are compared with)."""


@dataclass(frozen=True)
class Marker:
    """A point of interest: a save, an interruption or a resume, at ``step`` (on the curve at
    ``value``; a vertical line when ``value`` is ``None``)."""

    kind: MarkerKind
    step: int
    value: float | None = None


MISSING = ("drawing needs matplotlib, which is not installed (an extra: about 100 MB): "
           "pip install matplotlib, or pip install -e '.[plot]' in unbroken's folder")
"""What :func:`figure` raises (as ``ModuleNotFoundError``) without matplotlib; ``unbroken plot`` says it."""


def available() -> bool:
    """Whether matplotlib can be imported (:data:`MISSING` otherwise)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


SOFTWARE = "unbroken plot"
"""Written into every PNG (a tEXt chunk): a later plot may replace a file that carries it."""


def figure(curves: Sequence[Curve], *, markers: Sequence[Marker] = (), title: str = "", ylabel: str = "value",
           xlabel: str = "step", log_y: bool | None = None) -> Figure:
    """The matplotlib figure :func:`plot_curves` saves, to draw or inspect (each curve is one line,
    labelled, gid ``curve``; the markers of each kind one scatter, gid the kind, plus a dashed line per
    interruption; several markers at one place are drawn once, with ``×N`` next to it)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ModuleNotFoundError(MISSING, name="matplotlib") from e

    fig = Figure(figsize=(10, 5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    colour = 0
    for c in curves:
        dot: dict[str, Any] = {"marker": "o", "markersize": 4} if len(c.steps) == 1 else {}  # a lone point: no line
        if c.reference:
            ax.plot(c.steps, c.values, color="0.8", linewidth=6, solid_capstyle="round", label=c.label, zorder=1,
                    gid="curve", **dot)
        else:
            ax.plot(c.steps, c.values, color=COLOURS[colour % len(COLOURS)], linewidth=1.4, label=c.label, zorder=2,
                    gid="curve", **dot)
            colour += 1
    for kind, style in MARKERS.items():
        here = Counter((m.step, m.value) for m in markers if m.kind == kind)  # one mark per place, counted
        placed = [(s, v) for s, v in here if v is not None]
        if placed:
            ax.scatter([s for s, _ in placed], [v for _, v in placed], zorder=3, gid=kind, **style)
        for i, (step, value) in enumerate(here):
            if kind == "interruption" or value is None:
                first_unplaced = not placed and i == 0  # lines carry the legend entry only without points
                ax.axvline(step, color=style.get("color", "0.4"), linestyle="--", linewidth=0.8, alpha=0.6,
                           zorder=0, label=style["label"] if first_unplaced else None, gid=f"{kind}-line")
            if here[step, value] > 1 and kind != "save":  # two kills (or resumes) at the same place
                at, coords = ((step, value), "data") if value is not None else ((step, 0.98), ("data", "axes fraction"))
                ax.annotate(f"×{here[step, value]}", at, xycoords=coords, xytext=(6, 4), textcoords="offset points",
                            color=style.get("color", "0.25"), fontsize="small", gid=f"{kind}-count")
    values = [v for c in curves for v in c.values if math.isfinite(v)]
    positive = [v for v in values if v > 0]
    wide = bool(positive) and min(values) >= 0 and max(values) > LOG_SPAN * min(positive)
    if log_y if log_y is not None else wide:
        if values and min(values) <= 0:  # a loss that reaches exactly 0: linear near 0, logarithmic above
            ax.set_yscale("symlog", linthresh=min(positive, default=1e-12))
        else:
            ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    return fig


def plot_curves(curves: Sequence[Curve], out: str | Path, *, markers: Sequence[Marker] = (), title: str = "",
                ylabel: str = "value", xlabel: str = "step", log_y: bool | None = None) -> Path:
    """Draw ``curves`` and ``markers`` (:func:`figure`) into the PNG file ``out`` (its folder is created);
    return its path. Interruptions also get a dashed vertical line. ``log_y``: a logarithmic value axis; by
    default when no value is negative and they span more than two orders of magnitude (a loss; with exact
    zeros, a symmetric-log axis that is linear below the smallest positive value)."""
    fig = figure(curves, markers=markers, title=title, ylabel=ylabel, xlabel=xlabel, log_y=log_y)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": SOFTWARE})
    write_file_atomic(path, buf.getvalue(), sync_dir=False)  # a link at ``path`` is replaced, never written through
    return path


def made_here(path: str | Path) -> bool:
    """Whether ``path`` is a PNG this module wrote (so replacing it destroys nothing of the user's)."""
    try:  # never through a link, never blocking on a FIFO
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW | os.O_NONBLOCK)) as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"Software\x00" + SOFTWARE.encode() in head


def run_curves(index: RunIndex, metric: str) -> tuple[list[Curve], list[Marker]]:
    """A run's ``metric`` from its index: one curve per segment (each process that wrote the run,
    also one that logged nothing: its curve is the point it resumed from, or empty; a resumed one
    starts at the value of the step it resumed from), and markers: saves (``saved`` /
    ``emergency_save`` events, one per place), resumes (that first point, one per segment) and
    interruptions, at most one per segment: its ``preempted`` or ``emergency_save`` event, or,
    when a later segment exists, where it stopped if the next one re-ran steps it had logged, started
    over, or it has no ``closed`` event (the process was killed: SIGKILL, the OOM killer, a lost
    node), or where it started if it logged nothing. Two kills at the same place are two markers
    (drawn once, counted). Segments written before ``closed`` events existed (unbroken 0.1) are
    judged by the other rules only: a kill right after a save the next one resumed from looks like
    a clean exit there."""
    per_segment: dict[int | None, list[tuple[int, float]]] = {}
    for step, value, segment in index.metric(metric):
        per_segment.setdefault(segment, []).append((step, value))
    segments = index.segments()  # every process that wrote the run, whether or not it logged the metric

    def value_at(step: int, segment: int | None) -> float | None:
        for seg in (segment, *per_segment):
            found = [v for s, v in per_segment.get(seg, []) if s == step]
            if found:
                return found[-1]
        return None

    curves, markers, stopped = [], [], {}
    for seg in segments:
        points = per_segment.get(seg["id"], [])
        how = f"resumed from {seg['resumed_from']}" if seg["resumed_from"] else "fresh start"
        if seg["resumed_from"]:  # the line starts at the checkpoint it resumed from
            start = value_at(seg["start_step"], None)
            markers.append(Marker("resume", seg["start_step"], start))
            points = [(seg["start_step"], start), *points] if start is not None else points
        label = f"segment {seg['id']} ({how}" + ("" if per_segment.get(seg["id"]) else f"; no {metric} logged") + ")"
        curves.append(Curve(label, [s for s, _ in points], [v for _, v in points]))
    events = index.events()
    for e in events:
        if e["step"] is None or e["kind"] == "closed":
            continue
        if e["kind"] in ("saved", "emergency_save"):
            markers.append(Marker("save", e["step"], value_at(e["step"], e["segment"])))
        if e["kind"] in ("preempted", "emergency_save") and e["segment"] not in stopped:
            stopped[e["segment"]] = Marker("interruption", e["step"], value_at(e["step"], e["segment"]))
    closed = [e for e in events if e["kind"] == "closed"]
    ended = {e["segment"] for e in closed if e["message"] == "ended"}
    for prev, nxt in itertools.pairwise(segments):
        own = per_segment.get(prev["id"])
        if prev["id"] in stopped:
            continue
        # killed (no close: the process did not end by itself), or closed by an exception
        abrupt = bool(closed) and prev["id"] not in ended
        if not own:  # it died before logging anything: where it started
            stopped[prev["id"]] = Marker("interruption", prev["start_step"], value_at(prev["start_step"], None))
        elif abrupt or nxt["start_step"] < own[-1][0] or not nxt["resumed_from"]:  # or steps re-run, or started over
            stopped[prev["id"]] = Marker("interruption", own[-1][0], own[-1][1])
    saves = list(dict.fromkeys(m for m in markers if m.kind == "save"))  # a step saved twice: one point
    return curves, [m for m in markers if m.kind != "save"] + saves + list(stopped.values())


def plot_run(index: RunIndex, metric: str, out: str | Path, title: str = "") -> Path:
    """Draw a run's ``metric`` (see :func:`run_curves`) into the PNG file ``out``; return its path."""
    curves, markers = run_curves(index, metric)
    return plot_curves(curves, out, markers=markers, title=title, ylabel=metric)
