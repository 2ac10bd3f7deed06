"""The run index ``<run>/index.sqlite``: a queryable history of one run, derived from the manifests.

Tables (their columns and the schema check: :mod:`unbroken.run.index.schema`): ``checkpoints`` (a row
per checkpoint, with its status), ``events``, ``segments`` (a row per process that wrote the run: a fresh
start or a resume), ``metrics`` (a per-step log, to check the loss curve of a resumed run against the
interrupted one) and ``progress`` (how far each segment got). Manifests stay the truth: a missing index
is created from them; a damaged one (not a database, failed ``PRAGMA quick_check``, unknown schema)
is moved aside to ``index.sqlite.corrupt-<time>`` with a warning and rebuilt (the file itself:
:mod:`unbroken.run.index.indexfile`, which also reads an index where nothing may be written). WAL mode with
``synchronous=NORMAL`` (commits survive a killed process); checkpoint records and ``close`` commit
with ``synchronous=FULL`` (they survive a power cut too); metrics are buffered and committed in
batches, at the latest with the next checkpoint, event or close, with each segment's progress
(:mod:`unbroken.run.index.progress`, the table an index written before it lacks). Readers never block the writer.
SQLite stores NaN as NULL, so a metric is kept as ``value`` (REAL, NULL for NaN; for SQL) and
``bits`` (its IEEE-754 bit pattern as a signed 64-bit integer; what the API returns and compares).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from ...checkpoint.manifests import read_manifest
from ...errors import UnbrokenError
from ...store import open_store
from .continuity import Continuity, compare
from .indexfile import SIDECARS, connect, move_aside, open_readonly, plain_files
from .progress import CREATE, UPSERT, SegmentProgress
from .schema import CKPT_INSERT, COLUMNS, INDEXES, SCHEMA_VERSION, STATUSES, TABLES, diagnose, schema_problem

log = logging.getLogger("unbroken")

INDEX_FILE = "index.sqlite"
DURABLE = "metrics_durable"
"""The kind of the internal event written at every save point: per metric, how many rows the
segment had logged and the last step, committed durably with those rows (see :meth:`RunIndex.mark_durable`).
:meth:`RunIndex.events` leaves these out unless asked for by kind."""
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")  # a float and its bit pattern
_json = partial(json.dumps, default=str)


def _ckpt_row(name: str, status: str, **known: Any) -> dict[str, Any]:
    """A checkpoints row: what is ``known``, else what the name tells (``step-000000500``)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, not {status!r}")
    m = re.search(r"step-(\d+)", name)
    return {"step": int(m.group(1)) if m else None, "metrics": "{}", "tags": "[]", "environment": "{}", **known,
            "name": name, "status": status}


def _decode(row: sqlite3.Row) -> dict[str, Any]:
    return {k: json.loads(v) if k in ("metrics", "tags", "environment", "data") and isinstance(v, str) else v
            for k, v in dict(row).items()}


class RunIndex:
    """The SQLite index of the run folder ``run_dir`` (created if missing, unless ``readonly``).

    ``readonly``: never write, move or rebuild the file, nor create anything beside it (works in a
    read-only folder: :func:`unbroken.run.index.indexfile.open_readonly`); if it is missing, damaged or cannot
    be read, use an index rebuilt from the manifests in memory (:attr:`in_memory`). Writing methods
    then raise ``RuntimeError``. Metrics are committed when ``flush_every`` rows are pending, after
    ``host_flush_seconds`` while every pending value is on the host, else after ``flush_seconds`` (reading
    a GPU tensor synchronises), and with any other write, query or :meth:`close`. A commit survives a
    killed process (WAL): a SIGKILL loses only the rows of its last fraction of a second.
    Thread-safe. Call :meth:`start_segment` before :meth:`log_metrics`; events and checkpoint rows
    carry the current segment (``None`` before the first)."""

    def __init__(self, run: Any, *, readonly: bool = False, flush_every: int = 256, flush_seconds: float = 5.0,
                 host_flush_seconds: float = 0.25, storage_options: Mapping[str, Any] | None = None) -> None:
        self.store = open_store(run, storage_options, readonly=readonly)
        self.run_dir = self.store.local_dir()
        self.path = self.run_dir / INDEX_FILE
        self.readonly, self.in_memory, self._lock = readonly, False, threading.RLock()
        self.flush_every, self.flush_seconds, self._last_flush = flush_every, flush_seconds, time.monotonic()
        self.host_flush_seconds = host_flush_seconds
        self._on_device = False  # a pending value is a tensor on a device (reading it synchronises)
        self.segment: int | None = None
        self._pending: list[tuple[int, int, str, Any, float]] = []
        self._progress: SegmentProgress | None = None  # this segment's, written with each commit
        self._scratch: str | None = None  # a private copy read instead of the file (see indexfile)
        self._conn: sqlite3.Connection | None = self._open_readonly() if readonly else self._open_writable()

    def _open_writable(self) -> sqlite3.Connection:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for suffix in ("", *SIDECARS):  # never follow a planted link; never replay a WAL of a deleted db
            if (side := Path(f"{self.path}{suffix}")).is_symlink() or (suffix and not self.path.exists()):
                side.unlink(missing_ok=True)
        if not plain_files(self.path):  # a FIFO would block SQLite's first read forever, a folder fail later
            raise OSError(f"{self.path} (or a -wal/-shm/-journal beside it) is not a regular file; move it away "
                          "to have the run index again")
        conn = connect(str(self.path))
        reason = "missing" if (problem := diagnose(conn)) == "" else None
        if problem:
            conn.close()
            aside = move_aside(self.path)
            log.warning("run index %s is damaged (%s); moved it to %s and rebuilt the index from the "
                        "manifests (its events, segments and metrics are lost)", self.path, problem, aside)
            conn, reason = connect(str(self.path)), "corrupt"
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        if reason:
            self._initialize(conn, reason)
        conn.execute(CREATE)  # an index written before the progress table gets it (nothing if it has it)
        return conn

    def _open_readonly(self) -> sqlite3.Connection:
        problem: str | None = ""
        if not plain_files(self.path):  # sqlite follows links and blocks on a FIFO
            log.warning("run index %s (or a -wal/-shm/-journal beside it) is not a regular file; using one "
                        "rebuilt in memory", self.path)
        else:
            conn, problem, self._scratch = open_readonly(self.path, schema_problem)
            if conn is not None:
                return conn
            if problem:
                log.warning("run index %s is damaged or unreadable (%s); using one rebuilt in memory", self.path,
                            problem)
        self.in_memory = True
        conn = connect(":memory:")
        self._initialize(conn, "corrupt" if problem else "missing")
        return conn

    def _initialize(self, conn: sqlite3.Connection, reason: str) -> None:
        """Create the schema and fill it from the manifests, unless another process just did."""
        with self._tx(conn=conn):
            if conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0] == 0:
                for ddl in [f"CREATE TABLE {t} ({spec})" for t, spec in TABLES.items()] + INDEXES:
                    conn.execute(ddl)
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                self._rebuild_rows(conn, reason)

    @contextmanager
    def _tx(self, durable: bool = False, conn: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction that also commits the buffered metrics; ``durable``: fsync."""
        if self.readonly and conn is None:
            raise RuntimeError(f"the run index {self.path} was opened readonly; use RunIndex(run_dir) to write")
        with self._lock:
            conn = conn if conn is not None else self._conn
            if conn is None:
                raise RuntimeError(f"the run index {self.path} is closed")
            conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")  # FULL: fsync the WAL at commit
            try:
                conn.execute("BEGIN IMMEDIATE")
                if n := len(self._pending):
                    conn.executemany("INSERT INTO metrics (step, segment, name, value, bits, time) "
                                     "VALUES (?, ?, ?, ?, ?, ?)", [self._metric_row(p) for p in self._pending])
                if (moved := self._progress) is not None and (snap := moved.snapshot()) is not None:
                    conn.execute(UPSERT, snap[1])
                yield conn
                conn.execute("COMMIT")
                if moved is not None and snap is not None:
                    moved.committed(snap[0])
                del self._pending[:n]
                self._last_flush = time.monotonic()
                self._on_device = bool(self._pending) and self._on_device
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")

    @staticmethod
    def _metric_row(p: tuple[int, int, str, Any, float]) -> tuple[int, int, str, float | None, int, float]:
        x = float(p[3])  # a tensor is read here, once per batch, not at every step
        return p[0], p[1], p[2], None if math.isnan(x) else x, _I64.unpack(_F64.pack(x))[0], p[4]

    def _insert_event(self, conn: sqlite3.Connection, kind: str, message: str = "", step: int | None = None,
                      checkpoint: str | None = None, data: Mapping[str, Any] | None = None,
                      segment: int | None = None) -> int:
        cur = conn.execute("INSERT INTO events (time, segment, kind, step, checkpoint, message, data) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?)", (time.time(), segment or self.segment, kind, step,
                                                            checkpoint, message, _json(dict(data or {}))))
        return int(cur.lastrowid or 0)

    def start_segment(self, resumed_from: str | None, start_step: int, tier: str = "") -> int:
        """Record that this process starts writing the run, with a ``run_started`` (or ``resumed``,
        whose data names the ``tier`` the checkpoint was read from) event; later metrics, events and
        checkpoint rows carry the returned segment id."""
        with self._tx() as conn:
            seg = int(conn.execute(
                "INSERT INTO segments (started, resumed_from, start_step, host, pid) VALUES (?, ?, ?, ?, ?)",
                (time.time(), resumed_from, start_step, socket.gethostname(), os.getpid())).lastrowid or 0)
            self._insert_event(conn, "resumed" if resumed_from else "run_started", step=start_step,
                               checkpoint=resumed_from, data={"tier": tier} if tier else None, segment=seg)
        self.segment = seg
        return seg

    def record_checkpoint(self, name: str, step: int, seq: int, epoch: int | None, created: float,
                          duration_s: float | None, size_bytes: int, kind: str, metrics: Mapping[str, Any],
                          tags: list[str], environment: Mapping[str, Any], status: str = "committed",
                          sync: bool = True) -> None:
        """Add (or replace) a checkpoint's row with a ``saved`` event (``emergency_save`` for kind
        ``emergency``), in one durable transaction that also commits the pending metrics."""
        row = _ckpt_row(name, status, step=step, seq=seq, epoch=epoch, created=created, duration_s=duration_s,
                        size_bytes=size_bytes, kind=kind, metrics=_json(dict(metrics)), tags=_json(list(tags)),
                        environment=_json(dict(environment)), segment=self.segment)
        with self._tx(durable=sync) as conn:  # sync=False: a RAM checkpoint (see mark_durable)
            conn.execute(CKPT_INSERT, [row.get(c) for c in COLUMNS["checkpoints"]])
            self._insert_event(conn, "emergency_save" if kind == "emergency" else "saved", step=step,
                               checkpoint=name, data={"kind": kind, "seq": seq, "size_bytes": size_bytes})

    def set_status(self, name: str, status: str, message: str = "") -> None:
        """Change a checkpoint's status durably; ``quarantined`` and ``pruned`` also log an event
        of that kind with ``message``. An unknown name gets a row with what its name tells."""
        row = _ckpt_row(name, status, segment=self.segment)
        with self._tx(durable=True) as conn:
            if conn.execute("UPDATE checkpoints SET status = ? WHERE name = ?", (status, name)).rowcount == 0:
                conn.execute(CKPT_INSERT, [row.get(c) for c in COLUMNS["checkpoints"]])
            if status != "committed":
                step = conn.execute("SELECT step FROM checkpoints WHERE name = ?", (name,)).fetchone()[0]
                self._insert_event(conn, status, message, step=step, checkpoint=name)

    def event(self, kind: str, message: str = "", step: int | None = None, checkpoint: str | None = None,
              data: Mapping[str, Any] | None = None) -> int:
        """Append an event (committed at once, with the pending metrics); return its id."""
        with self._tx() as conn:
            return self._insert_event(conn, kind, message, step, checkpoint, data)

    def mark_durable(self, step: int, rows: Mapping[str, tuple[int, int]], sync: bool = True) -> None:
        """At a save point: commit the buffered metrics durably (fsync), with a :data:`DURABLE` mark
        saying that this segment had logged ``rows[name] = (count, last_step)`` by then, so that
        :meth:`continuity` can tell a lost row from one never logged. ``sync=False`` (a save to the
        RAM tier, which a power cut loses anyway): committed so that a killed process keeps it, no fsync."""
        with self._tx(durable=sync) as conn:
            self._insert_event(conn, DURABLE, step=step, data={"rows": {k: list(v) for k, v in rows.items()}})

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Buffer one step's metrics for the current segment: numbers, numpy scalars or one-element
        tensors (cloned now and read only when the batch is committed: no GPU sync per step)."""
        if self.readonly or self.segment is None:
            raise RuntimeError("log_metrics() needs a writable RunIndex and start_segment() first")
        now, rows = time.time(), []
        for k, v in metrics.items():
            if isinstance(v, (str, bytes)) or (hasattr(v, "numel") and v.numel() != 1):
                raise TypeError(f"metric {k!r} is not a number or a one-element tensor: {v!r}")
            v = v.detach().clone() if hasattr(v, "detach") else float(v)
            rows.append((int(step), self.segment, str(k), v, now))
        with self._lock:
            self._pending.extend(rows)
            self._on_device = self._on_device or any(getattr(getattr(r[3], "device", None), "type", "cpu") != "cpu"
                                                     for r in rows)
            waited = time.monotonic() - self._last_flush
            if len(self._pending) >= self.flush_every or waited >= self.flush_seconds \
                    or (not self._on_device and waited >= self.host_flush_seconds):
                self.flush()

    def progressed(self, progress: SegmentProgress, at_once: bool = False) -> None:
        """Have ``progress`` (this segment's) committed with the next write, now if ``at_once`` or if nothing was
        committed for ``host_flush_seconds``: a SIGKILL loses at most that last fraction of a second of it."""
        with self._lock:
            self._progress = progress
            if at_once or time.monotonic() - self._last_flush >= self.host_flush_seconds:
                with self._tx():
                    pass

    def flush(self) -> None:
        """Commit the buffered metrics now."""
        with self._lock, (self._tx() if self._pending else nullcontext()):
            pass

    def rebuild(self) -> None:
        """Drop and recreate the ``checkpoints`` table from the manifests on disk.

        Committed folders become ``committed`` rows, folders in ``quarantine/`` ``quarantined`` ones
        (from what the name tells if the manifest is unreadable); committed folders with an unreadable
        manifest are left out and named in the ``index_rebuilt`` event. ``segment``, ``tags`` and
        ``duration_s`` (in no manifest) are kept from the old row of the same name and seq; old rows
        of folders no longer on disk are kept as ``pruned``. Events, segments and metrics are kept:
        this needs a readable database (a damaged one is replaced when opened, losing them all)."""
        with self._tx(durable=True) as conn:
            self._rebuild_rows(conn, "requested")

    def _rebuild_rows(self, conn: sqlite3.Connection, reason: str) -> None:
        old = {r["name"]: dict(r) for r in conn.execute("SELECT * FROM checkpoints")}
        conn.execute("DROP TABLE checkpoints")
        conn.execute(f"CREATE TABLE checkpoints ({TABLES['checkpoints']})")
        rows: dict[str, dict[str, Any]] = {}
        unreadable: list[str] = []
        places = [(self.store, name, "committed") for name in self.store.list_committed()]
        if (qstore := self.store.quarantined()) is not None:
            places += [(qstore, name, "quarantined") for name in qstore.list_committed()]
        for where, name, status in places:
            key = name if name not in rows else f"quarantine/{name}"  # a quarantined twin of a committed one
            try:
                m = read_manifest(where, name)
                prev = old[key] if key in old and old[key]["seq"] == m.seq else {}  # keep what no manifest holds
                rows[key] = _ckpt_row(key, status, step=m.step, seq=m.seq, epoch=m.progress.get("epoch"),
                                      created=m.created, size_bytes=m.total_bytes, kind=m.kind,
                                      metrics=_json(m.metrics), environment=_json(m.environment),
                                      tags=prev.get("tags", "[]"), duration_s=prev.get("duration_s"),
                                      segment=prev.get("segment"))
            except (UnbrokenError, OSError):
                if status == "committed":
                    unreadable.append(name)
                else:
                    rows[key] = _ckpt_row(key, status)
        quarantined = sum(r["status"] == "quarantined" for r in rows.values())
        committed = len(rows) - quarantined
        rows.update({n: {**r, "status": "pruned"} for n, r in old.items() if n not in rows})  # gone: deleted
        conn.executemany(CKPT_INSERT, [[r.get(c) for c in COLUMNS["checkpoints"]] for r in rows.values()])
        self._insert_event(conn, "index_rebuilt", f"{committed} committed, {quarantined} quarantined",
                           data={"reason": reason, "committed": committed, "quarantined": quarantined,
                                 "unreadable": unreadable})

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            self.flush()
            if self._conn is None:
                raise RuntimeError(f"the run index {self.path} is closed")
            return self._conn.execute(sql, args).fetchall()

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """The rows of one read-only SQL query (after committing the buffered metrics)."""
        return self._query(sql, args)

    def checkpoints(self, status: str | None = None) -> list[dict[str, Any]]:
        """Checkpoint rows (all, or those with ``status``), newest first (by seq, then step)."""
        where, args = ("WHERE status = ?", (status,)) if status else ("", ())
        return [_decode(r) for r in self._query(
            f"SELECT * FROM checkpoints {where} ORDER BY seq DESC, step DESC, name DESC", args)]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Events (all, or those of ``kind``), oldest first."""
        where, args = ("WHERE kind = ?", (kind,)) if kind else ("WHERE kind != ?", (DURABLE,))
        return [_decode(r) for r in self._query(f"SELECT * FROM events {where} ORDER BY id", args)]

    def segments(self) -> list[dict[str, Any]]:
        """Segments (the processes that wrote the run), oldest first."""
        return [dict(r) for r in self._query("SELECT * FROM segments ORDER BY id")]

    def metric_names(self) -> list[str]:
        """The names of every metric logged in the run, sorted."""
        return [r[0] for r in self._query("SELECT DISTINCT name FROM metrics ORDER BY name")]

    def metric(self, name: str) -> list[tuple[int, float, int | None]]:
        """``(step, value, segment)`` for every logged value of metric ``name``, in logging order."""
        return [(r[0], _F64.unpack(_I64.pack(r[1]))[0], r[2]) for r in self._query(
            "SELECT step, bits, segment FROM metrics WHERE name = ? ORDER BY rowid", (name,))]

    def continuity(self, name: str) -> Continuity:
        """Compare metric ``name`` at the steps logged by several segments (re-run after a resume):
        the values each segment logged there (in order) must be bitwise equal, as an exact resume
        re-logs identical values, and no row a :data:`DURABLE` mark promised may be missing. See
        :class:`~unbroken.run.index.continuity.Continuity`."""
        rows = self._query("SELECT step, bits, segment FROM metrics WHERE name = ? ORDER BY step, rowid", (name,))
        starts = {r["id"]: r["start_step"] for r in self.segments()}
        marks = [(m["segment"], m["data"].get("rows", {}).get(name)) for m in self.events(DURABLE)]
        return compare(name, [tuple(r) for r in rows], starts, marks)

    def close(self) -> None:
        """Commit pending metrics durably and close the database (idempotent)."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                try:
                    with self._tx(durable=True, conn=conn) if not self.readonly else nullcontext():
                        pass
                finally:
                    conn.close()
                    if self._scratch is not None:
                        shutil.rmtree(self._scratch, ignore_errors=True)
                        self._scratch = None

    def __enter__(self) -> RunIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
