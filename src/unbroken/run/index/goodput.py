"""Where a run's time went: ``unbroken goodput RUN``, from the run index alone.

A run is a sequence of segments (the processes that wrote it, and a new one after each in-process
rollback). A segment lives from its ``started`` (after ``restore()``, or its first step when it never
restored) to its **end**: its ``closed`` event, else the last sign of life the index holds (its last
step boundary, save, metric row or event; a killed process leaves nothing later). Then:

- **wall** = the last segment's end − the first segment's start;
- **restart** (segment *i* > 1) = its start − the end of segment *i*-1: the rest of the step a kill
  interrupted, the new interpreter, imports, the model build and the restore (**startup**, from the
  process's start to its restore, is shown apart when known);
- **blocked by saves** = the time ``save()`` held the training thread (all of a synchronous save;
  the snapshot of an async one, with any wait for the previous background save);
- **step time** = a segment's end − its start − its blocked time;
- **steps redone** = steps a segment computed that a later segment computed again (it resumed from
  an earlier step): those after the smallest ``start_step`` of the segments after it; their **time**
  runs from the moment the segment had finished the step resumed from (its save there, else its start,
  else its metric row there) to its last step boundary, less the saves in between, and is estimated
  as redone steps × the segment's mean step time when none of these is known;
- **productive** = step time − redone time; **ratio** = productive / wall (the effective training
  time ratio). The parts add up: wall = productive + redone + blocked + restart.

What an index written before the ``progress`` table (:mod:`unbroken.run.index.progress`) lacks is
reported as unknown (``None``), never as zero: its segments' blocked time, hence their step and
productive time and the ratio; their last step and redone steps come from metric rows and events
when the run logged any.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from .progress import TABLE, decode

if TYPE_CHECKING:
    from .index import RunIndex

LAST_STEP_KINDS = ("saved", "emergency_save", "closed", "preempted", "metrics_durable")
"""Events whose step the segment had reached (``resumed``/``run_started`` carry only its start)."""
NOT_ACTIVITY = ("rolled_back",)
"""Events of a segment that are no sign of its own activity: a rollback is recorded after the restore
that follows the failed step, which belongs to the restart of the next segment."""


@dataclass
class SegmentTime:
    """One segment's share of the run's time (seconds; ``None``: unknown, see the module docstring)."""

    id: int
    host: str | None
    pid: int | None
    resumed_from: str | None
    start_step: int
    started: float
    end: float
    how: str
    """``ended`` (closed normally), ``stopped`` (closed on a signal or an exception), ``rolled back`` (a new
    segment in the same process), ``not closed`` (killed, or still running)."""
    recorded: bool
    """The index has this segment's progress row (written by an unbroken that records it)."""
    last_step: int | None
    steps: int | None
    saves: int | None
    blocked_s: float | None
    step_s: float | None
    redone_steps: int | None
    redone_s: float | None
    redone_estimated: bool
    productive_s: float | None
    restart_s: float | None
    """Before this segment (``None`` for the first)."""
    startup_s: float | None
    """From this process's start to the segment's start (``None``: unknown, or the same process as before)."""
    save_points: list[tuple[int, float, float]] = field(default_factory=list, repr=False)
    """The newest saves as (step, when it stopped blocking, seconds blocked), for the picture."""
    redone_from: float | None = field(default=None, repr=False)
    """When the redone stretch began (for the picture)."""

    @property
    def active_s(self) -> float:
        return self.end - self.started


@dataclass
class Goodput:
    """A run's goodput: its segments and the totals (``None``: unknown)."""

    segments: list[SegmentTime]
    wall_s: float | None
    productive_s: float | None
    redone_steps: int | None
    redone_s: float | None
    restart_s: float | None
    blocked_s: float | None
    saves: int | None
    steps: int | None
    unknown: dict[str, str]
    """Why each unknown total is unknown."""

    @property
    def ratio(self) -> float | None:
        """Productive time / wall time."""
        if self.productive_s is None or not self.wall_s:
            return None
        return self.productive_s / self.wall_s

    @property
    def restarts(self) -> int:
        return max(0, len(self.segments) - 1)

    def as_json(self) -> dict[str, Any]:
        """The report as one JSON document (``unbroken goodput --json``)."""
        total = {"wall_s": self.wall_s, "productive_s": self.productive_s, "ratio": self.ratio,
                 "steps": self.steps, "redone_steps": self.redone_steps, "redone_s": self.redone_s,
                 "restarts": self.restarts, "restart_s": self.restart_s, "blocked_s": self.blocked_s,
                 "saves": self.saves, "segments": len(self.segments)}
        segs = []
        for s in self.segments:
            d = asdict(s)
            d.pop("save_points")
            d.pop("redone_from")
            d["active_s"] = s.active_s
            segs.append(d)
        return {"total": total, "segments": segs, "unknown": self.unknown}


def _sum(values: Iterable[float | int | None]) -> Any:
    """The sum, or ``None`` if any value is unknown."""
    vals = list(values)
    return None if any(v is None for v in vals) else sum(v for v in vals if v is not None)


def _has_progress(index: RunIndex) -> bool:
    return bool(index.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)))


def compute(index: RunIndex) -> Goodput:
    """The :class:`Goodput` of the run whose index is ``index`` (see the module docstring)."""
    rows = index.segments()
    progress = {r["segment"]: decode(r) for r in index.query(f"SELECT * FROM {TABLE}")} if _has_progress(index) else {}
    metric = {r[0]: (r[1], r[2]) for r in index.query(
        "SELECT segment, max(step), max(time) FROM metrics WHERE segment IS NOT NULL GROUP BY segment")}
    events: dict[int, list[tuple[str, int | None, float, str]]] = {}
    for e in index.query("SELECT segment, kind, step, time, message FROM events WHERE segment IS NOT NULL ORDER BY id"):
        events.setdefault(e[0], []).append((e[1], e[2], e[3], e[4] or ""))
    segments: list[SegmentTime] = []
    for i, row in enumerate(rows):
        later = [r["start_step"] for r in rows[i + 1:]]
        segments.append(_segment(index, row, progress.get(row["id"]), metric.get(row["id"]),
                                 events.get(row["id"], []), min(later) if later else None,
                                 segments[-1] if segments else None, rolled_back=any(
                                     k == "rolled_back" for k, *_ in events.get(row["id"], []))))
    return _totals(segments)


def _segment(index: RunIndex, row: dict[str, Any], p: dict[str, Any] | None, metric: tuple[int, float] | None,
             events: list[tuple[str, int | None, float, str]], resumed_at: int | None, prev: SegmentTime | None,
             rolled_back: bool) -> SegmentTime:
    seg, started, start_step = row["id"], row["started"], row["start_step"]
    points = [(int(s), float(t), float(b)) for s, t, b in p["save_points"]] if p else []
    closed = [m for k, _, _, m in events if k == "closed"]
    times = [started] + [t for k, _, t, _ in events if k not in NOT_ACTIVITY] + [t for _, t, _ in points]
    times += [v for v in (p["last_step_at"] if p else None, metric[1] if metric else None) if v is not None]
    end = max(times)
    how = closed[-1] if closed else "rolled back" if rolled_back else "not closed"
    reached = [s for k, s, _, _ in events if k in LAST_STEP_KINDS and s is not None]
    reached += [v for v in (p["last_step"] if p else None, metric[0] if metric else None) if v is not None]
    last_step = max(reached) if reached else (start_step if p else None)
    if p:
        steps, saves, blocked = p["steps"], p["saves"], p["blocked_s"]
    else:
        steps = last_step - start_step if last_step is not None else None
        saves, blocked = sum(k in ("saved", "emergency_save") for k, *_ in events), None
    step_s = max(0.0, end - started - blocked) if blocked is not None else None
    last_at = p["last_step_at"] if p and p["last_step_at"] is not None else metric[1] if metric else None
    redone_steps: int | None = 0
    redone_s: float | None = 0.0
    estimated, redone_from = False, None
    if resumed_at is not None:
        r = max(start_step, resumed_at)
        redone_steps = max(0, last_step - r) if last_step is not None else None
        if redone_steps:
            redone_s, redone_from, estimated = _redone_time(index, seg, r, start_step, started, last_at, points, p,
                                                            redone_steps, step_s, steps)
        elif redone_steps is None:
            redone_s = None
    if redone_s is not None and step_s is not None:
        redone_s = min(redone_s, step_s)
    productive = step_s - redone_s if step_s is not None and redone_s is not None else None
    restart = max(0.0, started - prev.end) if prev is not None else None
    born = p["process_started"] if p else None
    startup = started - born if born is not None and (prev is None or born >= prev.end) else None
    return SegmentTime(seg, row["host"], row["pid"], row["resumed_from"], start_step, started, end, how, p is not None,
                       last_step, steps, saves, blocked, step_s, redone_steps, redone_s, estimated, productive,
                       restart, startup, points, redone_from)


def _redone_time(index: RunIndex, seg: int, r: int, start_step: int, started: float, last_at: float | None,
                 points: list[tuple[int, float, float]], p: dict[str, Any] | None, redone_steps: int,
                 step_s: float | None, steps: int | None) -> tuple[float | None, float | None, bool]:
    """``(seconds, since when, estimated)`` of the steps after step ``r`` that segment ``seg`` computed."""
    since = next((t for s, t, _ in reversed(points) if s == r), None)
    if since is None and r == start_step:
        since = started
    if since is None:
        found = index.query("SELECT max(time) FROM metrics WHERE segment = ? AND step = ?", (seg, r))
        since = found[0][0] if found else None
    if since is not None and last_at is not None:
        between = sum(b for _, t, b in points if since < t <= last_at)
        if p is not None and r == start_step and p["saves"] > len(points):  # older save points were dropped
            between = p["blocked_s"] - sum(b for _, t, b in points if t > last_at)
        return max(0.0, last_at - since - between), since, False
    if step_s is not None and steps:
        return redone_steps * step_s / steps, None, True
    return None, None, False


def _totals(segments: list[SegmentTime]) -> Goodput:
    unknown: dict[str, str] = {}
    old = [s.id for s in segments if not s.recorded]
    if not segments:
        why = "the index has no segments (no process recorded the run: an index rebuilt from the manifests)"
        for name in ("wall_s", "productive_s", "ratio", "steps", "redone_steps", "redone_s", "restart_s",
                     "blocked_s", "saves"):
            unknown[name] = why
        return Goodput([], None, None, None, None, None, None, None, None, unknown)
    if old:
        names = ", ".join(map(str, old))
        why = (f"segment(s) {names} were written by an unbroken that did not record the time saves blocked "
               "(the index has no progress row for them)")
        for name in ("blocked_s", "productive_s", "ratio"):
            unknown[name] = why
    wall = segments[-1].end - segments[0].started
    total = Goodput(segments, wall, _sum(s.productive_s for s in segments), _sum(s.redone_steps for s in segments),
                    _sum(s.redone_s for s in segments), sum(s.restart_s or 0.0 for s in segments),
                    _sum(s.blocked_s for s in segments), _sum(s.saves for s in segments),
                    _sum(s.steps for s in segments), unknown)
    for name, value in (("redone_steps", total.redone_steps), ("redone_s", total.redone_s), ("steps", total.steps)):
        if value is None:
            lost = ", ".join(str(s.id) for s in segments if getattr(s, name) is None)
            unknown[name] = (f"segment(s) {lost}: no step reached is recorded (no progress row, metric row or "
                             "save of theirs)")
    return total


def failure_history(index: RunIndex, now: float) -> tuple[int, float]:
    """``(failures, wall_s)`` of the run so far, for ``save_every="auto"``: the segments before the current
    (last) one that ended losing work — killed or crashed without closing (``not closed``), rolled back, or
    followed by a segment that redid some of their steps (with several ranks, the rank that keeps the index
    fails in a collective when another is killed: its segment closes on the exception, yet its steps since
    the last save are lost) — and the seconds from the run's first segment to ``now`` (``time.time()``).
    A preemption saved at its last step, or an exception with an exact emergency checkpoint, lost nothing."""
    rows = compute(index).segments
    failures = sum(1 for seg in rows[:-1]
                   if seg.how in ("not closed", "rolled back") or (seg.redone_steps or 0) > 0)
    return failures, max(0.0, now - rows[0].started) if rows else 0.0


def lost_save_history(index: RunIndex, now: float) -> tuple[int, float]:
    """``(losses, wall_s)`` of the run so far, for ``RamTier(persist_every="auto")``: the restarts that resumed
    from an earlier step than the newest checkpoint the segment before them had saved — what it saved last was
    gone (the RAM checkpoints of a lost or rebooted node; a quarantined one too) — not counting in-process
    rollbacks (which may go back on purpose), and the seconds from the run's first segment to ``now``."""
    rows = compute(index).segments
    newest = {r[0]: r[1] for r in index.query(  # the events, not the checkpoints' rows: a step saved again by a
        "SELECT segment, max(step) FROM events WHERE kind IN ('saved', 'emergency_save') "  # later segment takes
        "AND segment IS NOT NULL GROUP BY segment")}  # over its row (one row per name)
    losses = sum(1 for before, after in pairwise(rows)
                 if before.how != "rolled back" and after.start_step < (newest.get(before.id) or 0))
    return losses, max(0.0, now - rows[0].started) if rows else 0.0
