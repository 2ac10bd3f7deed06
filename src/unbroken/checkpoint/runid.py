"""A run's identity: a random id created once in the run folder (``run-id``), never derived from its path.

What lives outside the run folder and belongs to it (the RAM tier's folder in ``/dev/shm``) is keyed
by this id as well as by the path: a run deleted and created again at the same path (``rm -rf
runs/exp1``), or another container's volume mounted at the same path on a node whose ``/dev/shm`` is
shared, has another id, so it never restores, prunes or persists the other's RAM checkpoints. A copy
of a run folder (``cp -r``) keeps the id, and is told apart by its path.

The file is written by the run's writer (under the run's lock) the first time a tier needs it, read
like every run-level file (no link followed, size bounded); one that is not an id is replaced, with
a warning (what it keyed is then simply not found: the disk tier still has the run).
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from ..errors import UnbrokenError

log = logging.getLogger("unbroken")

RUN_ID = "run-id"
_ID = re.compile(r"[0-9a-f]{32}")


def read_run_id(store: Any) -> str | None:
    """The run's id, or ``None`` if it has none yet (or one that is not an id)."""
    try:
        raw = store.read_meta(RUN_ID)
    except (OSError, UnbrokenError) as e:  # a link, a folder, a FIFO: not an id
        log.warning("the run's %s in %s cannot be read: %s", RUN_ID, store.url, e)
        return None
    text = raw.decode("ascii", "replace").strip() if raw is not None else ""
    return text if _ID.fullmatch(text) else None


def ensure_run_id(store: Any) -> str:
    """The run's id, created now if it has none (call as the run's writer, holding its lock)."""
    found = read_run_id(store)
    if found is not None:
        return found
    new = uuid.uuid4().hex
    try:
        present = store.read_meta(RUN_ID) is not None
    except (OSError, UnbrokenError):
        present = True
    if present:
        log.warning("the run's %s in %s is not an id; replacing it (a RAM tier keyed by the old one is not used)",
                    RUN_ID, store.url)
    store.write_meta(RUN_ID, (new + "\n").encode())
    return new
