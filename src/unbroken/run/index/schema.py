"""The run index's tables (:mod:`unbroken.run.index.index`), its schema version, and the check that
an index file is ours: healthy (``PRAGMA quick_check``), with exactly these tables' columns and
this version. The ``progress`` table (:mod:`unbroken.run.index.progress`) came later without a new
version: an index may lack it (then a writer adds it), but one it has must have its columns.
"""

from __future__ import annotations

import sqlite3

from . import progress
from .indexfile import damage, is_damage

SCHEMA_VERSION = 1
STATUSES = ("committed", "quarantined", "pruned")
TABLES = {
    "schema_version": "version INTEGER NOT NULL",
    "segments": "id INTEGER PRIMARY KEY AUTOINCREMENT, started REAL NOT NULL, resumed_from TEXT, "
                "start_step INTEGER NOT NULL, host TEXT, pid INTEGER",
    "checkpoints": "name TEXT PRIMARY KEY, step INTEGER, seq INTEGER, epoch INTEGER, created REAL, "
                   "duration_s REAL, size_bytes INTEGER, kind TEXT, status TEXT NOT NULL, metrics TEXT NOT NULL, "
                   "tags TEXT NOT NULL, environment TEXT NOT NULL, segment INTEGER",
    "events": "id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, segment INTEGER, kind TEXT NOT NULL, "
              "step INTEGER, checkpoint TEXT, message TEXT NOT NULL, data TEXT NOT NULL",
    "metrics": "step INTEGER NOT NULL, segment INTEGER, name TEXT NOT NULL, value REAL, bits INTEGER NOT NULL, "
               "time REAL NOT NULL",
}
COLUMNS = {t: [c.split()[0] for c in spec.split(", ")] for t, spec in TABLES.items()}
INDEXES = ["CREATE INDEX events_kind ON events (kind)", "CREATE INDEX metrics_name ON metrics (name, step)"]
CKPT_INSERT = (f"INSERT OR REPLACE INTO checkpoints ({', '.join(COLUMNS['checkpoints'])}) "
               f"VALUES ({', '.join('?' * len(COLUMNS['checkpoints']))})")


def diagnose(conn: sqlite3.Connection) -> str | None:
    """``None`` if the index is healthy, ``""`` if it has no tables yet, else what is wrong."""
    problem = damage(conn)
    return schema_problem(conn) if problem is None else problem


def schema_problem(conn: sqlite3.Connection) -> str | None:
    """``None`` if the tables are ours, ``""`` if there are none yet, else what differs."""
    try:
        if not {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}:
            return ""
        for table, cols in COLUMNS.items():
            have = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
            if have != cols:
                return f"unexpected schema: table {table} has columns {have}, expected {cols}"
        if (versions := [r[0] for r in conn.execute("SELECT version FROM schema_version")]) != [SCHEMA_VERSION]:
            return f"schema version {versions}, expected [{SCHEMA_VERSION}]"
        have = [r[1] for r in conn.execute(f"PRAGMA table_info({progress.TABLE})")]
        if have and have != progress.COLUMNS:  # absent: an index written before it (the writer adds it)
            return f"unexpected schema: table {progress.TABLE} has columns {have}, expected {progress.COLUMNS}"
    except sqlite3.DatabaseError as e:  # damage is SQLITE_CORRUPT or SQLITE_NOTADB; busy, I/O, ... propagate
        if not is_damage(e):
            raise
        return str(e)
    return None
