"""Where the suite keeps what is expensive to build (the LLaMA-Factory environment, DeepSpeed's compiled
op): a folder named by a key of everything the build depends on, so that a build is reused only while
its inputs are unchanged and rebuilt, never trusted, when they change.

The root is ``UNBROKEN_TEST_CACHE`` when it is set (``make test`` sets it to a folder outside the clone,
``~/.cache/unbroken-test``, so a clean clone on a machine that ran the suite before reuses the builds);
otherwise the test session's temporary root, shared by its pytest-xdist workers, so that a plain
``pytest`` writes nothing outside its temporary folders."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
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
