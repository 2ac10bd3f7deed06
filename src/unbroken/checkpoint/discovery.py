"""Finding checkpoints in one store: listing (read-only) and the newest *valid* one.

Listing reads manifests only. Finding the newest valid checkpoint verifies every byte
(:func:`unbroken.checkpoint.reader.read_checkpoint`) from the newest commit (highest ``seq``)
backwards and reports each invalid one to a callback (the run quarantines it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpointError, UnbrokenError
from ..format.manifest import Manifest
from ..store.retry import is_transient
from .manifests import CheckpointInfo, read_manifest
from .tags import tags_by_checkpoint

if TYPE_CHECKING:
    from .reader import LoadedCheckpoint


def manifests(store: Any, *, raise_transient: bool = False) -> dict[str, Manifest]:
    """The readable manifests of a store's committed checkpoints (unreadable ones left out).
    ``raise_transient``: a read that failed with a transient error (:func:`~unbroken.store.retry.is_transient`:
    a server not answering yet) raises instead, for a caller that must not take "unreadable now" for "absent"."""
    out = {}
    for name in store.list_committed():
        try:
            out[name] = read_manifest(store, name)
        except (UnbrokenError, OSError) as e:
            if raise_transient and is_transient(e):
                raise
            continue
    return out


def discover(store: Any, tier: str = "") -> list[CheckpointInfo]:
    """Committed checkpoints of a store with a readable manifest, newest first; read-only."""
    found = manifests(store)
    tags = tags_by_checkpoint(store, {n: m.tags for n, m in found.items()})
    tiers = (tier,) if tier else ()
    out = [CheckpointInfo.of(store.describe(n), n, m, tuple(sorted(tags.get(n, ()))), tiers)
           for n, m in found.items()]
    return sorted(out, key=lambda c: (c.seq, c.step), reverse=True)


def newest_valid(store: Any, on_invalid: Callable[[str, str], None],
                 only: Callable[[str], bool] = lambda name: True) -> tuple[LoadedCheckpoint | None, int]:
    """The newest checkpoint that verifies, and how many committed checkpoints were seen.

    ``on_invalid(name, reason)`` is called for each one that fails, newest first; ``only``
    picks the names to consider (e.g. those with a tag). Read-only: nothing is moved or locked.
    A checkpoint from a newer format raises :class:`~unbroken.errors.NewerFormatError`.
    """
    from .reader import read_checkpoint  # decoding tensors imports torch: listing (above) does not

    candidates: list[tuple[int, int, str]] = []
    for name in store.list_committed():
        if not only(name):
            continue
        try:
            m = read_manifest(store, name)
        except CorruptCheckpointError as e:
            on_invalid(name, str(e))
            continue
        candidates.append((m.seq, m.step, name))
    for _, _, name in sorted(candidates, reverse=True):
        try:
            return read_checkpoint(store, name), len(candidates)
        except (CorruptCheckpointError, FileNotFoundError) as e:  # pruned while we read: the next one
            on_invalid(name, str(e))
    return None, len(candidates)


def tagged(store: Any, tag: str) -> set[str]:
    """The names of the committed checkpoints of ``store`` that carry ``tag``."""
    found = manifests(store)
    return {n for n, tags in tags_by_checkpoint(store, {n: m.tags for n, m in found.items()}).items() if tag in tags}


def merge_tiers(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """One entry per checkpoint (``seq``, ``step``) listed in several tiers, newest first: the
    last one listed wins (its path), with the tiers and tags of all."""
    merged: dict[tuple[int, int], CheckpointInfo] = {}
    for c in infos:
        key = (c.seq, c.step)
        if key in merged:
            c = replace(c, tiers=tuple(sorted(set(merged[key].tiers) | set(c.tiers))),
                        tags=tuple(sorted(set(merged[key].tags) | set(c.tags))))
        merged[key] = c
    return sorted(merged.values(), key=lambda c: (c.seq, c.step), reverse=True)
