"""The repository must not change while the tests run: every test writes only inside its tmp_path.

:func:`snapshot` records every path under the repository (files, folders, links, with size and
modification time), walking into ignored folders too (``runs/``, ``checkpoints/``: a write inside an
already ignored folder is still seen), and skipping only the caches that tools and Python themselves
keep (:data:`CACHES`) and pytest's own base temporary folder if it lies inside the repository.
:func:`changes` lists what a session created, removed or modified, except an engineer's own work,
which goes on beside a long session: a file git tracks that is modified (``git diff`` shows it), and
a source file being written: untracked, not ignored, in a folder that holds tracked files (``src/``,
``tests/``, ``docs/``), other than the repository's root. Everything else is reported: any change at
the root (where a tool run from the repository writes: ``checkpoints/``, ``lightning_logs/``), any new
folder, anything git ignores, anything in a folder without tracked files, a tracked file removed.
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
    res = _git(root, "ls-files", "-z")
    return set(res.split("\0")) - {""} if res is not None else set()


def _git(root: Path, *args: str, stdin: str | None = None) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(root), *args], input=stdin, capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode in (0, 1) else None  # check-ignore: 1 = none ignored


def changes(before: dict[str, Entry], after: dict[str, Entry], tracked_files: set[str],
            root: Path | None = None) -> list[str]:
    """What changed between two snapshots, one line per path (see the module docstring for what is an
    engineer's work and left out; ``root``: the git checkout asked which of those paths it ignores)."""
    source_dirs = {p.rpartition("/")[0] for p in tracked_files} - {""}

    def engineers(path: str, entry: Entry) -> bool:
        return entry[0] != "d" and path not in tracked_files and path.rpartition("/")[0] in source_dirs

    found = [("created", p) for p in sorted(after.keys() - before.keys())]
    found += [("removed", p) for p in sorted(before.keys() - after.keys())]
    found += [("modified", p) for p in sorted(before.keys() & after.keys())
              if before[p] != after[p] and p not in tracked_files]
    maybe = sorted({p for _, p in found if engineers(p, after.get(p) or before[p])})
    ignored = set()
    if maybe and root is not None:
        ignored = set((_git(root, "check-ignore", "--no-index", "--stdin", stdin="\n".join(maybe)) or "").split("\n"))
    return [f"{what}: {p}" for what, p in found if p not in maybe or p in ignored]
