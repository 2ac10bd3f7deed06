"""Finding checkpoints in a run folder: listing (read-only) and the newest *valid* one.

Listing reads manifests only. Finding the newest valid checkpoint verifies every byte
(:func:`unbroken.reader.read_checkpoint`) from the newest commit (highest ``seq``)
backwards and reports each invalid one to a callback (the Checkpointer quarantines it).
"""

from __future__ import annotations

from typing import Callable

from .api import CheckpointInfo
from .errors import CorruptCheckpointError, UnbrokenError
from .reader import LoadedCheckpoint, read_checkpoint, read_manifest
from .storage.local import LocalStorage
from .tags import tags_by_checkpoint


def discover(storage: LocalStorage) -> list[CheckpointInfo]:
    """Committed checkpoints of a run with a readable manifest, newest first; read-only."""
    manifests = {}
    for name in storage.list_committed():
        try:
            manifests[name] = read_manifest(storage, name)
        except (UnbrokenError, OSError):
            continue
    tags = tags_by_checkpoint(storage.root, {n: m.tags for n, m in manifests.items()})
    out = [CheckpointInfo.of(storage.describe(n), n, m, tuple(sorted(tags.get(n, ())))) for n, m in manifests.items()]
    return sorted(out, key=lambda c: (c.seq, c.step), reverse=True)


def newest_valid(storage: LocalStorage, on_invalid: Callable[[str, str], None]) -> tuple[LoadedCheckpoint | None, int]:
    """The newest checkpoint that verifies, and how many committed checkpoints were seen.

    ``on_invalid(name, reason)`` is called for each one that fails, newest first.
    A checkpoint from a newer format raises :class:`~unbroken.errors.NewerFormatError`.
    """
    candidates: list[tuple[int, int, str]] = []
    for name in storage.list_committed():
        try:
            m = read_manifest(storage, name)
        except CorruptCheckpointError as e:
            on_invalid(name, str(e))
            continue
        candidates.append((m.seq, m.step, name))
    for _, _, name in sorted(candidates, reverse=True):
        try:
            return read_checkpoint(storage, name), len(candidates)
        except CorruptCheckpointError as e:
            on_invalid(name, str(e))
    return None, len(candidates)
