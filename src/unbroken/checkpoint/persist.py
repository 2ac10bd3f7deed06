"""Step two of a save: write a :class:`~unbroken.checkpoint.snapshot.Snapshot` and commit it.

Every file is checksummed while it is written (no second read), made durable, and
listed with its size and xxh3-128 digest in ``manifest.json``, which is written last;
then the store commits (an atomic rename on a filesystem, the manifest PUT on an object
store). With several ranks each rank writes its part (:func:`write_part`) into the
staging area the coordinator opened, and the coordinator alone writes the manifest and
commits (:func:`commit`); with one process :func:`write_snapshot` does both. Any error,
an interrupt included, aborts the staging area, so a failed save leaves nothing a reader
would look at and every earlier checkpoint untouched.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .._support import faultpoints as _faults
from .._support import progress
from ..errors import InsufficientSpaceError, ReadOnlyRunError, StorageError, UnbrokenError
from ..format.manifest import MANIFEST, STATE_FILE, FileEntry, Manifest, new_hasher
from ..format.tensorfile import TensorEntry, write_tensor_file
from ..store.base import Staging, Store
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .chunks import ChunkSave


log = logging.getLogger("unbroken")

def writers() -> int:
    """Large tensor files of one save written at the same time, ``UNBROKEN_WRITERS`` (default 2; measured:
    2 files of 384 MB in 2 threads took 1.17-1.40 s against 1.39-2.25 s one after the other, on 2 cores).
    Read at each save, not at import."""
    return int(os.environ.get("UNBROKEN_WRITERS", "2"))
PARALLEL_MIN = 64 * 1024 * 1024
"""Only files at least this large are written in parallel."""


def tree_bytes(snapshot: Snapshot) -> bytes:
    return json.dumps(snapshot.tree, separators=(",", ":"), allow_nan=False).encode("utf-8")


def write_tensors(staging: Staging, fname: str, entries: list[TensorEntry]) -> FileEntry:
    """One safetensors file, checksummed while it is written."""
    h = new_hasher()

    def update(chunk: memoryview | bytes) -> None:
        h.update(chunk)
        progress.advance(len(chunk))

    with staging.open(fname) as f:
        size = write_tensor_file(f, entries, update, metadata={"format": "unbroken"},
                                 on_half=lambda: _faults.point("save.mid_file"))
    return FileEntry(size, h.hexdigest())


def write_blob(staging: Staging, fname: str, raw: bytes) -> FileEntry:
    with staging.open(fname) as f:
        f.write(raw)
    return FileEntry(len(raw), new_hasher_digest(raw))


def write_part(staging: Staging, snapshot: Snapshot, json_name: str | None, tensor_files: Iterable[str],
               chunks: ChunkSave | None = None) -> dict[str, FileEntry]:
    """Write some of ``snapshot``'s tensor files, and its tree as ``json_name`` (if given).
    With ``chunks`` (an incremental save) tensor files become chunk maps and new chunks."""
    snapshot.complete()  # deferred and device copies land in the staging buffers first
    tensor_files = list(tensor_files)
    total = sum(e.tensor.numel() * e.tensor.element_size() for f in tensor_files for e in snapshot.files[f])
    sizes = {f: sum(e.tensor.numel() * e.tensor.element_size() for e in snapshot.files[f]) for f in tensor_files}
    big = [f for f in tensor_files if sizes[f] >= PARALLEL_MIN]
    with progress.task("saving", total):
        files: dict[str, FileEntry] = {}
        mine = {f: snapshot.files[f] for f in tensor_files}
        if chunks is not None:
            for f in tensor_files:
                files.update(chunks.write_file(staging, f, snapshot.files[f],
                                               on_half=lambda: _faults.point("save.mid_file")))
        elif snapshot.writer is not None and (done := _in_writer_process(staging, snapshot.writer, mine)) is not None:
            files.update(done)
            progress.advance(total)
        elif len(big) > 1 and writers() > 1 and getattr(staging, "parallel_files", False):
            # local files: one file's write or fsync overlaps another's hashing
            with ThreadPoolExecutor(min(writers(), len(big)), thread_name_prefix="unbroken-write") as pool:
                futures = {f: pool.submit(write_tensors, staging, f, snapshot.files[f]) for f in big}
                files.update({f: fut.result() for f, fut in futures.items()})
        if chunks is None:
            files.update({f: write_tensors(staging, f, snapshot.files[f]) for f in tensor_files if f not in files})
    if json_name is not None:
        files[json_name] = write_blob(staging, json_name, tree_bytes(snapshot))
    return files


def _in_writer_process(staging: Any, writer: Any, mine: dict[str, list[TensorEntry]]) -> dict[str, FileEntry] | None:
    """A background save staged in shared memory: the writer process writes and hashes the tensor
    files (``None``: it cannot, see :meth:`~unbroken.checkpoint.background.filewriter.FileWriter.write`). If it dies
    meanwhile, what it left is removed and the files are written here instead."""
    from .background.filewriter import WriterDied

    half = (lambda: _faults.point("save.mid_file")) if _faults.armed("save.mid_file") else None
    try:
        return writer.write(staging, mine, {"format": "unbroken"}, on_half=half)
    except WriterDied as e:
        log.warning("%s: writing the save in this process instead", e)
        for f in mine:
            staging.discard(f)
        return {f: write_tensors(staging, f, entries) for f, entries in mine.items()}


def commit(staging: Staging, files: dict[str, FileEntry], **fields: Any) -> tuple[str, Manifest]:
    """Write the manifest of ``files`` (last) and commit; the final name and the manifest."""
    _faults.point("save.before_manifest")
    manifest = Manifest(files=files, **fields)
    with staging.open(MANIFEST) as f:
        f.write(manifest.to_json())
    _faults.point("save.before_commit")
    final = staging.commit()
    return final, manifest


def as_storage_error(e: Exception, name: str, where: Any) -> Exception:
    """One library error for a failed write (a disk, a server), keeping the errno: a
    :class:`ReadOnlyRunError` where the location cannot be written at all."""
    if isinstance(e, UnbrokenError):
        return e
    code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
    cls = ReadOnlyRunError if code in (errno.EROFS, errno.EACCES, errno.EPERM) else StorageError
    return cls(code, f"could not write checkpoint {name} to {getattr(where, 'url', where)} "
                              f"({type(e).__name__}: {e}); nothing was committed and earlier checkpoints "
                              "are intact")


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
    """Write ``snapshot`` as checkpoint ``name`` from one process; its committed name and manifest.

    Raises :class:`InsufficientSpaceError` before writing anything if the storage
    reports less free space than the checkpoint needs.
    """
    if snapshot.sharded:
        raise UnbrokenError("a snapshot with sharded tensors is saved by all ranks together (Checkpointer)")
    started = time.time()
    try:  # a folder that cannot be created or written fails here: one library error too
        check_space(storage, snapshot.nbytes + len(tree_bytes(snapshot)))
        staging = storage.stage(name)
    except OSError as e:
        raise as_storage_error(e, name, storage) from e
    try:
        files = write_part(staging, snapshot, STATE_FILE, snapshot.files)
        final, manifest = commit(staging, files, step=step, seq=seq, created=started, metrics=dict(metrics or {}),
                                 progress=dict(progress or {}), environment=dict(environment or {}), kind=kind,
                                 probe=dict(probe or {}), tags=list(tags or []))
    except Exception as e:
        staging.abort()
        raise as_storage_error(e, name, storage) from e
    except BaseException:
        staging.abort()
        raise
    _faults.point("save.after_commit")
    return final, manifest


def check_space(storage: Store, payload: int) -> None:
    """Fail early and clearly, instead of half-writing, when the checkpoint cannot fit."""
    own_rule = getattr(storage, "check_capacity", None)  # a store with its own rule (the RAM tier)
    if own_rule is not None:
        return own_rule(payload)
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
