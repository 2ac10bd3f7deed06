"""What the parts of a :class:`~unbroken.Checkpointer` share: one typed object, handed to each part.

The Checkpointer is a façade (:mod:`unbroken.checkpointer.manager`): its save path
(:mod:`unbroken.checkpointer.saving`), its step boundary (:mod:`unbroken.checkpointer.stepping`) and its
restore (:mod:`unbroken.checkpointer.restoring`) are parts that each get
this :class:`Core` when they are built or called, and use nothing else of the Checkpointer. It holds the
run (where bytes go, :mod:`unbroken.run.run`), the ranks (``comm``), the loop's counters, the save schedule,
the event bus, the checks on a state, the user's settings, and the few values that change as the run
goes (the metrics, the last checkpoint saved, whether the run was started or resumed).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..api import CheckpointInfo
from ..dist.comm import Comm
from ..events import EventBus
from ..faults import Preemption
from ..run.index.recorder import Recorder
from ..run.run import Run
from ..run.scheduling import Schedule
from ..state.stateful import Progress
from .environment import EnvCheck, fingerprint
from .probe import ProbeFn, ProbeReport
from .saved_state import StateRules


@dataclass(eq=False)
class Core:
    """The state the Checkpointer's parts share (see the module docstring). The first fields are set
    once, by the Checkpointer's constructor; the last ones change as the run goes."""

    run: Run
    comm: Comm
    progress: Progress
    schedule: Schedule
    events: EventBus
    rules: StateRules
    preemption: Preemption
    env: EnvCheck
    storage_options: Mapping[str, Any] | None
    probe: ProbeFn | None
    rng: bool
    strict: bool
    async_save: bool | Literal["lazy"]
    metrics: dict[str, Any] = field(default_factory=dict)
    """The metrics of the steps since the last save (replaced by a checkpoint's on restore)."""
    last_saved: CheckpointInfo | None = None
    probe_report: ProbeReport | None = None
    started: bool = False
    """``restore()`` ran (a resume or a fresh start), or a save found the run empty."""
    recorder: Recorder | None = None
    """The run index's writer (the coordinator of a writable run, once it began)."""
    _environment: dict[str, Any] | None = None
    _fingerprinting: tuple[threading.Thread, dict[str, Any]] | None = None

    @property
    def location(self) -> str:
        """The run's URL."""
        return self.run.url

    def environment(self) -> dict[str, Any]:
        """This process's environment fingerprint (computed once, at first use, or by the thread
        :meth:`fingerprint_meanwhile` started)."""
        self.join_fingerprint()
        if self._environment is None:  # never started, or it failed there: here, so it raises here
            self._environment = fingerprint(config=self.env.config, data=self.env.data)
        return self._environment

    def fingerprint_meanwhile(self) -> None:
        """Start computing :meth:`environment` in a thread, while a restore reads the checkpoint:
        it waits for package metadata and ``git`` (0.01-0.05 s), the read for the disk and the
        checksums. :meth:`join_fingerprint` (called when the restore returns) waits for it."""
        if self._environment is not None or self._fingerprinting is not None:
            return
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["env"] = fingerprint(config=self.env.config, data=self.env.data)
            except Exception:  # noqa: BLE001 - computed again on the caller's thread, where it raises
                pass

        thread = threading.Thread(target=run, name="unbroken-fingerprint", daemon=True)
        thread.start()
        self._fingerprinting = (thread, box)

    def join_fingerprint(self) -> None:
        """Wait for the thread :meth:`fingerprint_meanwhile` started (none is left running once a
        restore returns: a fork then copies no thread holding a lock)."""
        if self._fingerprinting is not None:
            thread, box = self._fingerprinting
            thread.join()
            self._fingerprinting = None
            if self._environment is None:
                self._environment = box.get("env")

    def saved_part(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The part of ``state`` that is saved and restored: all but the ``allow_unsaved`` keys."""
        return self.rules.saved_part(state)
