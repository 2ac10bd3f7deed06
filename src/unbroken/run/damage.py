"""What a run does with a checkpoint found invalid, and what it remembers of it.

A checkpoint that fails verification is reported (:class:`~unbroken.events.CorruptionFound`),
moved to ``quarantine/`` with its reason, and so are the damaged chunks it names (the next save
writes them again); a read-only run leaves it in place. One deleted while it was read (another
process's retention) is not damage: it is skipped silently. What was found, and what earlier
runs quarantined, is what :func:`unrestorable` lists when no checkpoint can be restored, so a
run with progress is never silently restarted from step 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ..checkpoint.manifests import read_manifest
from ..checkpoint.reader import vanished
from ..events import CorruptionFound, Event, Quarantined
from ..store.local import LocalStore
from .index.index import INDEX_FILE, RunIndex

log = logging.getLogger("unbroken")
_DAMAGED_CHUNK = re.compile(r"chunk ([0-9a-f]{64}): (?:checksum mismatch|damaged)")


class Damage:
    """The invalid checkpoints of one run, as this process found them."""

    def __init__(self, publish: Callable[[Event], None]) -> None:
        self.publish = publish
        self.unmoved: list[tuple[str, str]] = []  # found invalid, left in place: (checkpoint, reason)
        self.vanished = False  # a checkpoint was deleted while it was read

    def invalid(self, store: Any, name: str, reason: str, tier: str = "primary", readonly: bool = False) -> None:
        """Report checkpoint ``name`` of ``store`` as invalid and quarantine it (and its damaged chunks)."""
        where = store.describe(name)
        if vanished(store, name):  # deleted while read (by another process's retention): not damage
            self.vanished = True
            log.info("checkpoint %s was deleted while it was being read (not damaged); skipped", where)
            return
        self.publish(CorruptionFound(name, reason, tier))
        if readonly:
            self.unmoved.append((identified(store, name), reason))
            log.warning("checkpoint %s is invalid (left in place: the run is read-only): %s", where, reason)
            return
        for cid in sorted(set(_DAMAGED_CHUNK.findall(reason))):  # the next save writes it again
            moved_to = store.quarantine_chunk(cid, reason)
            if moved_to:
                log.warning("chunk %s is damaged and was quarantined to %s", cid, moved_to)
        moved = store.quarantine(name, reason)
        if moved:
            self.publish(Quarantined(name, reason, moved, tier))
            log.warning("checkpoint %s is invalid and was quarantined to %s: %s", where, moved, reason)
        else:
            self.unmoved.append((identified(store, name), reason))
            log.warning("checkpoint %s is invalid (and could not be moved to quarantine/): %s", where, reason)

    def unrestorable(self, stores: list[Any], unknown: str | None = None) -> list[tuple[str, str]]:
        """Why the run may hold progress that could not be restored, as ``(where, reason)``:
        checkpoints found invalid and left in place, every quarantined checkpoint of ``stores``
        (with its recorded reason) not acknowledged by a fresh start on purpose
        (:func:`acknowledge`), and ``unknown`` (a tier that could not be listed, never
        acknowledged: it is not known what it holds). Empty for a new run."""
        seen = acknowledged(stores[0]) if stores else set()
        return [x for x in self._found(stores, unknown)
                if x[0] not in seen or x[0] == unknown or x[0].endswith(_UNKNOWN)]

    def _found(self, stores: list[Any], unknown: str | None) -> list[tuple[str, str]]:
        found = list(self.unmoved) + (remembered(stores[0]) if stores else [])
        if unknown:
            found.append((unknown, "the remote tier could not be listed, so its checkpoints are unknown"))
        for store in stores:
            try:
                q = store.quarantined()
                names = q.list_committed() if q is not None else []
            except Exception as e:  # noqa: BLE001 - cannot look: say so rather than guess "nothing"
                found.append((f"{store.url} quarantine", f"cannot be listed: {e}"))
                continue
            for name in names:
                try:
                    raw = q.read_meta(f"{name}.reason.txt")
                except Exception:  # noqa: BLE001 - an odd reason file: the checkpoint still counts
                    raw = None
                reason = raw.decode("utf-8", "replace").strip() if raw else "quarantined (no reason recorded)"
                head, sep, rest = reason.partition(": ")
                found.append((identified(q, name), rest if sep and "/" in head else reason))  # not the old path
        return found


def remembered(store: Any) -> list[tuple[str, str]]:
    """The checkpoints the run index of a run on a filesystem records as committed, as ``(where,
    reason)``: asked only where none can be restored, so these vanished (deleted by hand, a storage
    that lost them) and the run had progress. ``where`` names the sequence number and the time of
    creation, so a later checkpoint of the same name (a fresh start numbers from 0 again) is never
    taken for one a fresh start acknowledged. A run index that is
    missing, damaged or not a plain file remembers nothing (a run with progress then has its
    manifests, or its quarantine, to tell)."""
    if not isinstance(store, LocalStore) or not (store.local_dir() / INDEX_FILE).is_file():
        return []  # (an object store's index is a cache of this machine's, not the run's own)
    try:
        with RunIndex(store.local_dir(), readonly=True) as index:
            rows = index.checkpoints("committed")
    except Exception as e:  # noqa: BLE001 - unreadable: the manifests and quarantine still tell
        log.warning("could not read the run index of %s to look for vanished checkpoints: %s", store.url, e)
        return []
    return [(f"{store.describe(str(r['name']))} (seq {r['seq']}, created {_when(r['created'])})",
             f"committed at step {r['step']} (the run index {INDEX_FILE} records it) and now absent")
            for r in rows]


_UNKNOWN = "(identity unknown)"
"""How a checkpoint with no identity is named: never taken as acknowledged."""


def identified(store: Any, name: str) -> str:
    """Where checkpoint ``name`` of ``store`` is, with what tells it from a later checkpoint that
    takes the same name (a fresh start numbers its saves from 0 again): see :func:`identity`."""
    found = identity(store, name)
    return f"{store.describe(name)} " + (f"({found})" if found else _UNKNOWN)


def identity(store: Any, name: str) -> str | None:
    """What tells checkpoint ``name`` of ``store`` apart from a later one of the same name: the
    sequence number and creation time its manifest records, else (a manifest too damaged to
    read) the folder's inode and modification time on a filesystem; ``None`` if neither can be
    read. A name alone is not enough: after a fresh start, a new checkpoint can take the name of
    one that was acknowledged (once the old one was deleted or moved out of quarantine/)."""
    try:
        m = read_manifest(store, name)
        return f"seq {m.seq}, created {_when(m.created)}"
    except Exception:  # noqa: BLE001 - damaged: the folder itself may still tell
        pass
    st = None
    if isinstance(store, LocalStore):
        with contextlib.suppress(OSError), store.folder.open() as rfd:
            st = os.stat(name, dir_fd=rfd, follow_symlinks=False) if rfd is not None else None
    return None if st is None else f"inode {st.st_ino}, modified {_when(st.st_mtime_ns / 1e9)}"


def _when(created: Any) -> str:
    try:
        return datetime.fromtimestamp(float(created), UTC).isoformat(timespec="microseconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return "at an unknown time"


FRESH_STARTS = "fresh-starts.json"
"""Run-level file: the damaged checkpoints a fresh start on purpose acknowledged (so a relaunch
before the first new save does not raise again, and the user need not keep the override set)."""


def acknowledged(store: Any) -> set[str]:
    """The checkpoints acknowledged by earlier fresh starts on purpose (unreadable: none)."""
    try:
        raw = store.read_meta(FRESH_STARTS)
        doc = json.loads(raw) if raw else {}
        return {str(x) for x in doc.get("acknowledged", [])} if isinstance(doc, dict) else set()
    except Exception:  # noqa: BLE001 - damaged or odd: acknowledge nothing (the safe side)
        return set()


def acknowledge(store: Any, lost: list[tuple[str, str]], unknown: str | None) -> None:
    """Record that the user started fresh knowing ``lost`` (a tier that could not be listed is
    never recorded). Best effort: a run that cannot be written keeps asking."""
    names = sorted(acknowledged(store) | {where for where, _ in lost if where != unknown})
    try:
        store.write_meta(FRESH_STARTS, json.dumps({"acknowledged": names}, indent=1).encode())
    except Exception as e:  # noqa: BLE001 - read-only or full: the next start asks again
        log.warning("could not record the fresh start in %s (%s); the next start will ask again", FRESH_STARTS, e)
