"""What the manifests of a run say, read without torch: the light half of reading.

Listing a run (``unbroken ls``), its index (``events``, ``metrics``, ``plot``) and deciding
whether a folder is a run need only the manifests, never a tensor. They live here, apart from
:mod:`unbroken.checkpoint.reader` (which verifies and decodes whole checkpoints, and imports torch), so
that those commands start without importing torch. :mod:`unbroken.checkpoint.reader` and
:mod:`unbroken.api` re-export these names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError
from ..format.manifest import MANIFEST, Manifest
from ..store import open_store, split_checkpoint
from ..store.base import Store as Storage


@dataclass(frozen=True)
class CheckpointInfo:
    """What is known about one committed checkpoint (from its manifest)."""

    name: str
    path: str
    step: int
    seq: int
    created: float
    size_bytes: int
    metrics: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, int] = field(default_factory=dict)
    kind: str = "regular"
    tags: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    """Where copies are committed: ``("local",)``, ``("remote",)`` or both (tiered runs)."""

    @classmethod
    def of(cls, path: str, name: str, m: Manifest, tags: tuple[str, ...] | None = None,
           tiers: tuple[str, ...] = ()) -> CheckpointInfo:
        return cls(name=name, path=path, step=m.step, seq=m.seq, created=m.created,
                   size_bytes=m.total_bytes, metrics=dict(m.metrics), progress=dict(m.progress),
                   kind=m.kind, tags=tuple(sorted(m.tags)) if tags is None else tags, tiers=tiers)


def read_manifest(storage: Storage, name: str) -> Manifest:
    """The manifest of checkpoint ``name`` (parsed and checked; its files are not read)."""
    return Manifest.from_json(bytes(storage.read(name, MANIFEST)))


def vanished(storage: Storage, name: str, seq: int | None = None) -> bool:
    """Whether checkpoint ``name`` is no longer committed in ``storage`` (deleted or moved since it
    was listed), or another checkpoint (another ``seq``) now has its name. Asked after a read
    failed, it tells "pruned while read" from damage; ``False`` when it cannot be told."""
    try:
        if name not in storage.list_committed():
            return True
        try:
            return seq is not None and read_manifest(storage, name).seq != seq
        except CorruptCheckpointError:  # its manifest is unreadable: damaged, unless it is gone by now
            return name not in storage.list_committed()
    except Exception:  # noqa: BLE001 - the listing failed: report the read's own error
        return False


def is_run(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bool:
    """True if ``path`` is a run (holds committed checkpoints) rather than one checkpoint."""
    store, name = split_checkpoint(path, storage_options)
    if store.remote:
        if name in store.list_committed():
            return False
    elif not os.path.isdir(os.fspath(path)) or os.path.exists(os.path.join(os.fspath(path), "manifest.json")):
        return False
    return bool(open_store(path, storage_options, readonly=True).list_committed())
