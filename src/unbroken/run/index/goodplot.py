"""The picture of ``unbroken goodput RUN --plot FILE.png``: where the run's time went.

Above, a time line: one row per segment (process), from its start to its end, in green where it
trained steps that count, orange where it computed steps a later segment redid, blue for each save
that blocked training (the newest saves the index keeps), and red for the restart before it (hatched:
from the new process's start to its restore, when known). Below, one bar of the totals: productive,
redone, blocked by saves, restarts, with their shares of the wall time. Unknown parts (an index older
than the progress table) are left out and named in the title. Drawn like ``unbroken plot``
(:mod:`unbroken.run.index.plotting`): matplotlib's object API, Agg, the file written atomically and
marked as unbroken's.
"""

from __future__ import annotations

import io
from pathlib import Path

from ...store.dirfd import write_file_atomic
from .goodput import Goodput
from .plotting import MISSING, SOFTWARE

COLOURS = {"productive": "#2ca02c", "redone": "#ff7f0e", "blocked by saves": "#1f77b4", "restart": "#d62728"}


def plot_goodput(g: Goodput, out: str | Path, title: str = "") -> Path:
    """Draw ``g`` (see the module docstring) into the PNG file ``out``; return its path."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ModuleNotFoundError(MISSING, name="matplotlib") from e

    fig = Figure(figsize=(10, 2.2 + 0.45 * max(1, len(g.segments))), dpi=100, layout="constrained")
    line, bar = fig.subplots(2, 1, height_ratios=[max(2, len(g.segments)), 1.2])
    t0 = g.segments[0].started if g.segments else 0.0
    for row, s in enumerate(g.segments):
        y = (row - 0.35, 0.7)
        if s.restart_s:
            line.broken_barh([(s.started - s.restart_s - t0, s.restart_s)], y, color=COLOURS["restart"])
            if s.startup_s is not None and s.startup_s <= s.restart_s:  # the new process's start-up, hatched
                line.broken_barh([(s.started - s.startup_s - t0, s.startup_s)], y, facecolor=COLOURS["restart"],
                                 edgecolor="white", hatch="//", linewidth=0)
        line.broken_barh([(s.started - t0, s.active_s)], y, color=COLOURS["productive"] if s.productive_s is not None
                         else "0.75")
        if s.redone_s:
            start = s.redone_from if s.redone_from is not None else s.started + (s.step_s or 0.0) - s.redone_s
            line.broken_barh([(start - t0, s.redone_s)], y, color=COLOURS["redone"])
        if s.save_points:
            line.broken_barh([(t - b - t0, b) for _, t, b in s.save_points], y, color=COLOURS["blocked by saves"])
    line.set_yticks(range(len(g.segments)), [f"segment {s.id}" for s in g.segments])
    line.invert_yaxis()
    line.set_xlabel("seconds since the run started")
    line.grid(axis="x", alpha=0.3)
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles.append(Patch(facecolor=COLOURS["restart"], edgecolor="white", hatch="//", label="restart: start-up"))
    line.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    parts = {"productive": g.productive_s, "redone": g.redone_s, "blocked by saves": g.blocked_s,
             "restart": g.restart_s}
    left = 0.0
    for name, value in parts.items():
        if value:
            bar.barh(0, value, left=left, color=COLOURS[name], height=0.6)
            if g.wall_s:
                bar.text(left + value / 2, 0, f"{100 * value / g.wall_s:.0f}%", ha="center", va="center",
                         fontsize="small", color="white")
            left += value
    bar.set_yticks([0], ["total"])
    bar.set_xlim(0, max(g.wall_s or 0.0, left) or 1.0)
    bar.set_xlabel("seconds")
    missing = [k for k, v in parts.items() if v is None]
    head = title or "goodput"
    ratio = f"effective training time ratio {g.ratio:.3f}" if g.ratio is not None else "ratio unknown"
    fig.suptitle(f"{head}\n{ratio}" + (f" (unknown: {', '.join(missing)})" if missing else ""), fontsize="medium")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": SOFTWARE})
    write_file_atomic(path, buf.getvalue(), sync_dir=False)  # a link at ``path`` is replaced, never written through
    return path
