"""Deterministic fault injection for the end-to-end tests (not public API).

``UNBROKEN_FAULTS="save.mid_file=2,save.before_commit=1"`` makes this process
SIGKILL itself the 2nd time it reaches ``save.mid_file``, and so on; ``save.mid_file@1=2``
arms the point on rank 1 only (``RANK`` in the environment, as torchrun sets it).
``UNBROKEN_FAULT_ACTION=stop`` makes the point SIGSTOP the process instead (a test then
signals it while it is frozen in the middle of a save, and SIGCONTs it). The points sit
at the dangerous moments of a save: half-way through a tensor file, after the data
files but before the manifest, and after the manifest but before the commit.
``UNBROKEN_FAULT_DELAY=0.3`` makes every point sleep that long (slow storage: a background
save is then certainly still in flight while training goes on).
``UNBROKEN_FAULT_ONCE=/path/marker`` lets the fault fire in the first process that reaches it only
(it creates the marker; a process started later with the same environment, such as the RAM tier's
next writer process, finds it and goes on).
Unset (the normal case), a point costs a pid comparison and one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

POINTS = ("save.mid_file", "save.before_manifest", "save.before_commit", "save.after_commit",
          "gc.after_mark", "gc.mid_sweep", "copy.after_file", "copy.before_manifest", "peers.after_file")
"""``gc.*`` are in the collection of unused chunks (:mod:`unbroken.checkpoint.chunks`): after the manifests
are read, and after the first chunk is deleted. ``copy.*`` are in the copy of a checkpoint to
another tier (:func:`unbroken.tiers.remote.copy_checkpoint`: an upload, a download, the RAM tier's
writer process): after each data file, and before the manifest. ``peers.after_file`` is in the copy
of a RAM save to the other nodes (:mod:`unbroken.tiers.rampeers`): after each file a node received."""


def _parse(spec: str, rank: str) -> dict[str, int]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, nth = part.partition("=")
        name, _, only = name.partition("@")
        if not only or only == rank:
            out[name] = int(nth or 1)
    return out


class _Plan:
    """What the environment asks of this process, read at its first fault point (not at import: a process
    forked from one that imported unbroken, as a fork server's child, has an environment of its own)."""

    def __init__(self) -> None:
        self.action = signal.SIGSTOP if os.environ.get("UNBROKEN_FAULT_ACTION") == "stop" else signal.SIGKILL
        self.spec = _parse(os.environ.get("UNBROKEN_FAULTS", ""), os.environ.get("RANK", "0"))
        self.delay = float(os.environ.get("UNBROKEN_FAULT_DELAY", "0") or 0)
        self.pid = os.getpid()


_plan: _Plan | None = None
_hits: Counter[str] = Counter()


def _current() -> _Plan:
    global _plan
    if _plan is None or _plan.pid != os.getpid():
        _plan = _Plan()
    return _plan


def point(name: str) -> None:
    """Mark a fault point; kill the process here if the environment asks for it."""
    plan = _current()
    if plan.delay:
        time.sleep(plan.delay)
    if name in plan.spec:
        _hits[name] += 1
        if _hits[name] == plan.spec[name] and _first():
            os.kill(os.getpid(), plan.action)


def armed(name: str) -> bool:
    """Whether reaching ``name`` may do something (kill, stop or sleep) in this process."""
    plan = _current()
    return bool(plan.delay) or name in plan.spec


def _first() -> bool:
    marker = os.environ.get("UNBROKEN_FAULT_ONCE")
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True
