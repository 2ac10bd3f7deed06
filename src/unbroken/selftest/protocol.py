"""The environment variables by which ``unbroken selftest`` talks to the script's Checkpointer.

The script is not modified: its :class:`~unbroken.Checkpointer` reads these at construction.

- ``UNBROKEN_SELFTEST=<dir>``: selftest mode; fingerprints are appended to ``<dir>/records.jsonl``
  (rank 0; under torchrun rank ``r > 0`` to ``<dir>/records.rank<r>.jsonl``, see :func:`records_file`).
- ``UNBROKEN_SELFTEST_RUN=<folder>``: the run location used instead of the one the script gave,
  so the selftest owns fresh run folders.
- ``UNBROKEN_SELFTEST_SEGMENT=<n>``: which process of the run this is (0, 1, ...).
- ``UNBROKEN_SELFTEST_STOP=<N>``: end the process cleanly (``SystemExit(0)``) after step N.
- ``UNBROKEN_SELFTEST_KILL=<kind>@<step>``: interrupt this process after the first step >= ``step``:
  ``sigkill`` (SIGKILL itself), ``sigterm`` (SIGTERM itself: unbroken's preemption path saves and
  exits 75), ``exception`` (raise from ``ckpt.step``), ``between`` (SIGKILL itself when a DataLoader
  other than the training one serves its first batch after that step: inside the work between
  two steps, an evaluation). A kill *inside a save* uses the fault points
  of :mod:`unbroken._support.faultpoints` (``UNBROKEN_FAULTS=save.mid_file=1``) instead. Under torchrun only
  rank 0 carries out the interruption (``save.mid_file@0=1`` for a kill inside a save); the others
  follow it: torchrun tears them down, or unbroken's preemption stops every rank at the same step.
- ``UNBROKEN_SELFTEST_LINES=1``: record which lines of the script ran (the uninterrupted run only;
  :mod:`.lines`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..faults.host import Host
    from .hooks import Hooks

DIR, RUN, SEGMENT, STOP, KILL, LINES = ("UNBROKEN_SELFTEST", "UNBROKEN_SELFTEST_RUN", "UNBROKEN_SELFTEST_SEGMENT",
                                        "UNBROKEN_SELFTEST_STOP", "UNBROKEN_SELFTEST_KILL", "UNBROKEN_SELFTEST_LINES")
RECORDS = "records.jsonl"


def records_file(rank: int = 0) -> str:
    """The name of the records file of ``rank`` (``RANK``, as torchrun sets it): ``records.jsonl`` for
    rank 0 (and a single process), ``records.rank<r>.jsonl`` for the others."""
    return RECORDS if rank == 0 else f"records.rank{rank}.jsonl"


INJECTED = "unbroken selftest: injected exception"
"""The message of the exception raised for an ``exception`` interruption (the runner looks for it)."""


def active() -> bool:
    """Whether this process runs under ``unbroken selftest``."""
    return bool(os.environ.get(DIR))


def run_location(location: Any) -> Any:
    """The run location a Checkpointer uses: the selftest's own folder in selftest mode."""
    override = os.environ.get(RUN)
    return override if override and active() else location


def attach(ckpt: Host) -> Hooks | None:
    """The in-process recorder for ``ckpt`` (:class:`unbroken.selftest.hooks.Hooks`), or ``None``
    outside selftest mode (then nothing else of this package is imported)."""
    if not active():
        return None
    from .hooks import Hooks

    return Hooks(ckpt)
