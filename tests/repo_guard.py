"""The repository must not change while the tests run: every test writes only inside its tmp_path.

:func:`snapshot` records every path under the repository (files, folders, links, with size and
modification time), walking into ignored folders too (``runs/``, ``checkpoints/``: a write inside an
already ignored folder is still seen), and skipping only the caches that tools and Python themselves
keep (:data:`CACHES`) and pytest's own base temporary folder if it lies inside the repository.
:func:`changes` lists what a session created, removed, or modified (modifications of files git tracks
are left out: an engineer may edit the sources while the tests run, and ``git diff`` shows those).
``tests/conftest.py`` fails the session, naming the paths, if the list is not empty.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
from pathlib import Path

CACHES = (".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache",
          "*.egg-info", ".coverage", ".coverage.*")
"""Names (globs) of entries skipped wherever they are: caches written by Python and the tools, not by tests."""

Entry = tuple[str, int, int]  # kind (f, d, l), size, mtime in ns


def _skipped(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CACHES)


def snapshot(root: Path, skip: Path | None = None) -> dict[str, Entry]:
    """Every path under ``root`` (relative, ``/``-separated) but the caches and ``skip``."""
    out: dict[str, Entry] = {}
    skip_s = os.path.realpath(skip) if skip is not None else None
    for folder, dirs, files in os.walk(root):
        if skip_s is not None and os.path.realpath(folder) == skip_s:
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not _skipped(d)]
        for name in [*dirs, *files]:
            if _skipped(name):
                continue
            path = os.path.join(folder, name)
            st = os.lstat(path)
            kind = "l" if os.path.islink(path) else "d" if os.path.isdir(path) else "f"
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if skip_s is not None and os.path.realpath(path) == skip_s:
                continue
            out[rel] = (kind, st.st_size if kind == "f" else 0, st.st_mtime_ns if kind == "f" else 0)
    return out


def tracked(root: Path) -> set[str]:
    """The files git tracks under ``root`` (none if it is not a git checkout)."""
    try:
        res = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(res.stdout.decode(errors="replace").split("\0")) - {""} if res.returncode == 0 else set()


def changes(before: dict[str, Entry], after: dict[str, Entry], tracked_files: set[str]) -> list[str]:
    """What changed between two snapshots, one line per path: created, removed, modified (untracked)."""
    lines = [f"created: {p}" for p in sorted(after.keys() - before.keys())]
    lines += [f"removed: {p}" for p in sorted(before.keys() - after.keys())]
    lines += [f"modified: {p}" for p in sorted(before.keys() & after.keys())
              if before[p] != after[p] and p not in tracked_files]
    return lines
