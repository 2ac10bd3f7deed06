"""The run index's ``progress`` table: how far each segment (process) got and what its saves cost.

One row per segment, replaced as the segment goes (never a row per step): the time and number of
its first and last step boundary, how many step boundaries it saw, how many saves it made and how
long they blocked training in all (an async save blocks only for its snapshot; a synchronous one
for the whole write), and its last :data:`KEEP` save points (step, time the save stopped
blocking, seconds it blocked) to tell which of its steps a later segment re-ran. It is what
``unbroken goodput`` (:mod:`unbroken.run.index.goodput`) reads beside the segments, events and
metrics every index has.

A step boundary costs no commit of its own while metrics are logged: the row rides on the run index's
next transaction (a metrics batch, an event, a checkpoint record, ``close``), and a step boundary
commits it by itself only when nothing was committed for ``host_flush_seconds`` (0.25 s). So a
SIGKILL loses at most that last fraction of a second of steps, as it does metric rows (their time
then counts as restart time, not as steps redone: the effective training time ratio is the same).
The end of a save commits it at once (one commit without fsync, beside the save's own), so the time a
save blocked is kept unless the process dies inside that save.

The table was added without a new schema version: an index written before it has no such table
(its segments report what the other tables tell, the rest as unknown), and an older unbroken that
opens a newer index only sees a table it does not know, which it leaves alone (it treats any other
schema version as damage and rebuilds the index, losing its history).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from typing import Any

TABLE = "progress"
SPEC = ("segment INTEGER PRIMARY KEY, process_started REAL, first_step INTEGER, first_step_at REAL, "
        "last_step INTEGER, last_step_at REAL, steps INTEGER NOT NULL, saves INTEGER NOT NULL, "
        "blocked_s REAL NOT NULL, save_points TEXT NOT NULL")
COLUMNS = [c.split()[0] for c in SPEC.split(", ")]
CREATE = f"CREATE TABLE IF NOT EXISTS {TABLE} ({SPEC})"
UPSERT = f"INSERT OR REPLACE INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
KEEP = 16
"""Save points kept per segment (the newest): enough to find the one a successor resumed from."""


def process_started() -> float | None:
    """When this process started (Unix time, to about 10 ms; Linux ``/proc``), else ``None``."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class SegmentProgress:
    """One segment's progress row, kept in memory and changed at each step boundary and save (cheap:
    a few assignments); :meth:`snapshot` gives the row to write when it changed since the last commit."""

    def __init__(self, segment: int, started: float | None = None) -> None:
        self.segment, self.process_started = segment, started
        self.first_step: int | None = None
        self.first_step_at: float | None = None
        self.last_step: int | None = None
        self.last_step_at: float | None = None
        self.steps = self.saves = 0
        self.blocked_s = 0.0
        self.save_points: deque[tuple[int, float, float]] = deque(maxlen=KEEP)
        self._version = self._committed = 0
        self._lock = threading.Lock()  # a commit may come from another thread (a background save's record)

    def step(self, step: int, now: float) -> None:
        """A step boundary: step ``step`` is done, at Unix time ``now``."""
        if self.first_step is None:
            self.first_step, self.first_step_at = step, now
        self.last_step, self.last_step_at = step, now
        self.steps += 1
        self._version += 1

    def saved(self, step: int, blocked_s: float, now: float) -> None:
        """A save of step ``step`` stopped blocking training at ``now``, after ``blocked_s`` seconds."""
        with self._lock:
            self.saves += 1
            self.blocked_s += blocked_s
            self.save_points.append((step, now, blocked_s))
            self._version += 1

    def snapshot(self) -> tuple[int, tuple[Any, ...]] | None:
        """``(version, row)`` to write, or ``None`` if nothing changed since the last :meth:`committed`."""
        with self._lock:
            if self._version == self._committed:
                return None
            points = json.dumps([[s, round(t, 6), round(b, 6)] for s, t, b in self.save_points])
            return self._version, (self.segment, self.process_started, self.first_step, self.first_step_at,
                                   self.last_step, self.last_step_at, self.steps, self.saves, self.blocked_s, points)

    def committed(self, version: int) -> None:
        """The row of ``version`` (from :meth:`snapshot`) is committed."""
        with self._lock:
            self._committed = max(self._committed, version)


def decode(row: Any) -> dict[str, Any]:
    """A ``progress`` row as a dict, its save points as ``[(step, time, blocked_s), ...]``."""
    d = dict(row)
    d["save_points"] = [tuple(p) for p in json.loads(d.get("save_points") or "[]")]
    return d
