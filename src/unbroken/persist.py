"""Step two of a save: write a :class:`~unbroken.snapshot.Snapshot` and commit it.

Every file is checksummed while it is written (no second read), made durable, and
listed with its size and xxh3-128 digest in ``manifest.json``, which is written
last; then the storage commits (an atomic rename on a filesystem). Any error, an
interrupt included, aborts the staging area, so a failed save leaves nothing a
reader would look at and every earlier checkpoint untouched.
"""

from __future__ import annotations

import errno
import json
import time
from typing import Any

from . import _faults
from .errors import InsufficientSpaceError, StorageError, UnbrokenError
from .format.manifest import MANIFEST, STATE_FILE, FileEntry, Manifest, new_hasher
from .format.tensorfile import write_tensor_file
from .snapshot import Snapshot
from .store.base import Store


def write_snapshot(
    snapshot: Snapshot,
    storage: Store,
    name: str,
    *,
    step: int,
    seq: int,
    metrics: dict[str, Any] | None = None,
    progress: dict[str, int] | None = None,
    environment: dict[str, Any] | None = None,
    kind: str = "regular",
    probe: dict[str, float] | None = None,
    tags: list[str] | None = None,
) -> tuple[str, Manifest]:
    """Write ``snapshot`` as checkpoint ``name``; return its committed name and manifest.

    Raises :class:`InsufficientSpaceError` before writing anything if the storage
    reports less free space than the checkpoint needs.
    """
    started = time.time()
    raw = json.dumps(snapshot.tree, separators=(",", ":"), allow_nan=False).encode("utf-8")
    check_space(storage, snapshot.nbytes + len(raw))
    staging = storage.stage(name)
    try:
        files: dict[str, FileEntry] = {}
        for fname, entries in snapshot.files.items():
            h = new_hasher()
            with staging.open(fname) as f:
                size = write_tensor_file(f, entries, h.update, metadata={"format": "unbroken"},
                                         on_half=lambda: _faults.point("save.mid_file"))
            files[fname] = FileEntry(size, h.hexdigest())
        with staging.open(STATE_FILE) as f:
            f.write(raw)
        files[STATE_FILE] = FileEntry(len(raw), new_hasher_digest(raw))
        _faults.point("save.before_manifest")
        manifest = Manifest(step=step, seq=seq, files=files, created=started, metrics=dict(metrics or {}),
                            progress=dict(progress or {}), environment=dict(environment or {}), kind=kind,
                            probe=dict(probe or {}), tags=list(tags or []))
        with staging.open(MANIFEST) as f:
            f.write(manifest.to_json())
        _faults.point("save.before_commit")
        final = staging.commit()
    except UnbrokenError:
        staging.abort()
        raise
    except Exception as e:  # a disk, a server: one library error that keeps the errno
        staging.abort()
        code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
        raise StorageError(code, f"could not write checkpoint {name} to {getattr(storage, 'url', storage)} "
                                 f"({type(e).__name__}: {e}); nothing was committed and earlier checkpoints "
                                 "are intact") from e
    except BaseException:
        staging.abort()
        raise
    _faults.point("save.after_commit")
    return final, manifest


def check_space(storage: Store, payload: int) -> None:
    """Fail early and clearly, instead of half-writing, when the checkpoint cannot fit."""
    free_bytes = getattr(storage, "free_bytes", None)
    free = free_bytes() if free_bytes is not None else None
    if free is None:  # object stores: no such thing as free space
        return
    need = int(payload * 1.01) + (1 << 20)  # headers, manifest, filesystem slack
    if free < need:
        raise InsufficientSpaceError(
            f"not enough space for the next checkpoint: it needs about {need / 1e6:.1f} MB, "
            f"{free / 1e6:.1f} MB are free. Earlier checkpoints are intact. Free space, lower "
            "keep_last, or save to a bigger disk.")


def new_hasher_digest(raw: bytes) -> str:
    h = new_hasher()
    h.update(raw)
    return h.hexdigest()
