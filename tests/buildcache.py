"""Where the suite keeps what is expensive to build (the LLaMA-Factory environment, DeepSpeed's compiled
op): a folder named by a key of everything the build depends on, so that a build is reused only while
its inputs are unchanged and rebuilt, never trusted, when they change.

The root is ``UNBROKEN_TEST_CACHE`` when it is set (``make test`` sets it to a folder outside the clone,
``~/.cache/unbroken-test``, so a clean clone on a machine that ran the suite before reuses the builds);
otherwise the test session's temporary root, shared by its pytest-xdist workers, so that a plain
``pytest`` writes nothing outside its temporary folders."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache root: ``UNBROKEN_TEST_CACHE``, or the session's temporary root common to the workers."""
    cache = os.environ.get("UNBROKEN_TEST_CACHE")
    if cache:
        path = Path(cache)
        path.mkdir(parents=True, exist_ok=True)
        return path
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # .../pytest-N/popen-gwK -> .../pytest-N


def key(*inputs: Path | str) -> str:
    """A short hash of the build's inputs (files by content, strings as given), of this interpreter and
    of the pins every build shares (``constraints.txt``)."""
    h = hashlib.sha256()
    for part in (REPO / "constraints.txt", sys.version, platform.machine(), *inputs):
        data = part.read_bytes() if isinstance(part, Path) else part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def folder(cache_root: Path, name: str, digest: str) -> Path:
    """``<root>/<name>-<digest>``; folders of the same name with another key (stale builds made by this
    module: they hold a ``.key`` file) are removed."""
    for old in cache_root.glob(f"{name}-*"):
        if old.name != f"{name}-{digest}" and (old / ".key").is_file() and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    return cache_root / f"{name}-{digest}"


# ----------------------------------------------------------------------------------------------- ninja
# torch compiles an extension with ninja, which rebuilds when an input's mtime is newer than the output's
# in its log: a clean clone installs DeepSpeed's sources anew (new mtimes, the same bytes), so a cached op
# would be compiled again at every session (a minute of both cores). After a session, when ninja's log
# says the build is newer than its inputs, the content hash and mtime of every file the build can read
# (the tree holding its sources and ``-I`` folders) are recorded; at the next session, a file whose bytes
# are unchanged gets its recorded mtime back, and ninja finds nothing to do. A file that changed keeps its
# new mtime, and a changed command (another venv path) is in ninja's own log: ninja rebuilds. ninja itself
# is never run here (a dry run rewrites its log).
INPUTS = "inputs.json"


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive lock of ``folder`` among the session's workers (and other sessions)."""
    with open(folder / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _input_tree(build: Path) -> Path | None:
    """The folder holding every source and ``-I`` folder of ``build/build.ninja`` (None: none named)."""
    text = (build / "build.ninja").read_text()
    paths = re.findall(r"^build \S+: compile (\S+)$", text, re.M)
    for line in text.splitlines():
        if line.startswith("cflags ="):
            paths += re.findall(r"(?:^|\s)-I(\S+)", line)
    paths = [p for p in paths if os.path.isabs(p)]
    return Path(os.path.commonpath(paths)) if paths else None


def _log_mtimes(build: Path) -> dict[str, int]:
    """output -> the mtime ninja's log recorded for it (its own clock: nanoseconds)."""
    got = {}
    try:
        lines = (build / ".ninja_log").read_text().splitlines()
    except OSError:
        return {}
    for line in lines[1:]:  # "# ninja log vN", then "start end mtime output command-hash" rows
        cols = line.split("\t")
        if len(cols) == 5 and cols[2].isdigit():
            got[cols[3]] = int(cols[2])
    return got


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_ninja_inputs(extensions: Path) -> None:
    """For each build under ``extensions`` that ninja's log says is newer than every file it can read,
    write the hash and mtime of those files."""
    for build in sorted(p.parent for p in extensions.glob("*/build.ninja")):
        tree, built = _input_tree(build), _log_mtimes(build)
        outputs = re.findall(r"^build (\S+):", (build / "build.ninja").read_text(), re.M)
        if tree is None or not tree.is_dir() or not outputs or not all(o in built for o in outputs):
            continue
        files = sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
        if any(p.stat().st_mtime_ns > min(built[o] for o in outputs) for p in files):
            continue  # a file newer than the build: not what it was built from
        inputs = {str(p): [_digest(p), p.stat().st_mtime_ns] for p in files}
        tmp = build / (INPUTS + ".tmp")
        tmp.write_text(json.dumps(inputs))
        os.replace(tmp, build / INPUTS)


def restore_ninja_inputs(extensions: Path) -> int:
    """Give the recorded mtime back to every recorded file whose bytes are unchanged; returns how many."""
    restored = 0
    for build in sorted(p.parent for p in extensions.glob("*/build.ninja")):
        try:
            recorded = json.loads((build / INPUTS).read_text())
        except (OSError, ValueError):
            continue
        for name, (digest, mtime_ns) in recorded.items():
            path = Path(name)
            if path.is_file() and path.stat().st_mtime_ns != mtime_ns and _digest(path) == digest:
                os.utime(path, ns=(path.stat().st_atime_ns, mtime_ns))
                restored += 1
    return restored
