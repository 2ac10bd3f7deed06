"""The run index's SQLite file: connecting, telling damage from health, moving a damaged file
aside, and opening it for reading where nothing may be written.

Why reading needs more than ``mode=ro``: the index is in WAL mode, and SQLite opens a WAL
database read-only only if its ``-shm`` file exists or can be created. A run folder on a
read-only filesystem or mount, or one this user may not write (a run shared by someone else,
folders ``0555``), has neither once its writer closed cleanly. :func:`open_readonly` then opens
it ``immutable`` (nothing to replay: no ``-wal`` file); if a write-ahead log was left (a killed
writer) but no ``-shm``, it reads a private copy of the database and its log in a temporary
folder. Nothing is ever created, moved or changed next to the index.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SIDECARS = ("-wal", "-shm", "-journal")
BUSY_TIMEOUT_S = 30.0
TABLES_CHECK = Callable[[sqlite3.Connection], "str | None"]


def connect(target: str, uri: bool = False) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), rows by name, shared by threads."""
    conn = sqlite3.connect(target, uri=uri, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    return conn


def damage(conn: sqlite3.Connection) -> str | None:
    """``None`` if ``PRAGMA quick_check`` passes, else what is wrong. Only damage (SQLITE_CORRUPT,
    SQLITE_NOTADB) is reported; any other error (busy, I/O, cannot open) is raised."""
    try:
        if (rows := [tuple(r) for r in conn.execute("PRAGMA quick_check")]) != [("ok",)]:
            return "quick_check: " + "; ".join(str(r[0]) for r in rows[:3])
    except sqlite3.DatabaseError as e:
        if not is_damage(e):
            raise
        return str(e)
    return None


def is_damage(e: sqlite3.DatabaseError) -> bool:
    """Whether ``e`` says the file is damaged (SQLITE_CORRUPT or SQLITE_NOTADB)."""
    code = getattr(e, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in (11, 26)
    return bool(re.search("malformed|not a database", str(e)))


def linked(path: Path) -> bool:
    """Whether the database or one of its sidecar files is a symbolic link (never followed)."""
    return any(Path(f"{path}{s}").is_symlink() for s in ("", *SIDECARS))


def move_aside(path: Path) -> Path:
    """Rename a damaged database (and its sidecars) to ``<name>.corrupt-<time>``; the new name."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    os.replace(path, target)
    for suffix in SIDECARS:  # a stale WAL would be replayed into the new database
        if Path(f"{path}{suffix}").exists():
            os.replace(f"{path}{suffix}", f"{target}{suffix}")
    return target


def open_readonly(path: Path, check: TABLES_CHECK) -> tuple[sqlite3.Connection | None, str, str | None]:
    """Open the database at ``path`` for reading, writing nothing beside it.

    Returns ``(connection, "", scratch)`` for a healthy database (``scratch``: a temporary folder
    holding a private copy, which the caller removes after closing, or ``None``), or
    ``(None, problem, None)``: ``problem`` is ``""`` if there is no usable file (none, a link, or
    no tables yet), else why it cannot be used (damage, as found by :func:`damage` and ``check``,
    the schema check, or why it cannot be opened at all)."""
    if not path.exists() or linked(path):
        return None, "", None
    wal = Path(f"{path}-wal")
    uri = path.absolute().as_uri()
    tries: list[Callable[[], tuple[sqlite3.Connection, str | None]]] = [
        lambda: (connect(f"{uri}?mode=ro", uri=True), None)]
    if not wal.exists() or wal.stat().st_size == 0:  # nothing to replay: the file alone is the database
        tries.append(lambda: (connect(f"{uri}?mode=ro&immutable=1", uri=True), None))
    else:
        tries.append(lambda: _private_copy(path, wal))
    failures: list[str] = []
    for attempt in tries:
        conn, scratch = None, None
        try:
            conn, scratch = attempt()
            problem = damage(conn)
            problem = check(conn) if problem is None else problem
        except (sqlite3.Error, OSError) as e:
            failures.append(f"{type(e).__name__}: {e}")
            problem = None
            if conn is not None:
                conn.close()
            _remove(scratch)
            continue
        if problem is None:
            return conn, "", scratch
        conn.close()
        _remove(scratch)
        return None, problem, None
    return None, "cannot be opened read-only (" + "; ".join(failures) + ")", None


def _private_copy(path: Path, wal: Path) -> tuple[sqlite3.Connection, str]:
    """The database and its write-ahead log copied into a new temporary folder, opened there
    (SQLite replays the log into the copy, never into the original)."""
    scratch = tempfile.mkdtemp(prefix="unbroken-index-")
    try:
        copy = Path(scratch) / path.name
        shutil.copyfile(path, copy)
        shutil.copyfile(wal, f"{copy}-wal")
        return connect(str(copy)), scratch
    except BaseException:
        _remove(scratch)
        raise


def _remove(scratch: str | None) -> None:
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def plain_files(path: Path) -> bool:
    """The index and its sidecars are regular files (not links, FIFOs, folders) or absent."""
    for suffix in ("", *SIDECARS):
        try:
            if not stat.S_ISREG(os.lstat(f"{path}{suffix}").st_mode):
                return False
        except FileNotFoundError:
            pass
    return True
