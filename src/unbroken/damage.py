"""What a run does with a checkpoint found invalid, and what it remembers of it.

A checkpoint that fails verification is reported (:class:`~unbroken.events.CorruptionFound`),
moved to ``quarantine/`` with its reason, and so are the damaged chunks it names (the next save
writes them again); a read-only run leaves it in place. One deleted while it was read (another
process's retention) is not damage: it is skipped silently. What was found, and what earlier
runs quarantined, is what :func:`unrestorable` lists when no checkpoint can be restored, so a
run with progress is never silently restarted from step 0.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from .events import CorruptionFound, Event, Quarantined
from .reader import vanished

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
            self.unmoved.append((where, reason))
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
            self.unmoved.append((where, reason))
            log.warning("checkpoint %s is invalid (and could not be moved to quarantine/): %s", where, reason)

    def unrestorable(self, stores: list[Any], unknown: str | None = None) -> list[tuple[str, str]]:
        """Why the run may hold progress that could not be restored, as ``(where, reason)``:
        checkpoints found invalid and left in place, every quarantined checkpoint of ``stores``
        (with its recorded reason), and ``unknown`` (a tier that could not be listed). Empty
        for a new run."""
        found = list(self.unmoved)
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
                found.append((q.describe(name), rest if sep and "/" in head else reason))  # not the old path
        return found
