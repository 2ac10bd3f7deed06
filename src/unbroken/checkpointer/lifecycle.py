"""A :class:`~unbroken.Checkpointer`'s time as its run's writer: how it begins and how it ends.

The first ``restore()``, ``save()`` or ``step()`` begins the :class:`Session`: the run's writer lock
(:mod:`unbroken.run.run`), the leftovers of interrupted saves removed, the signal handlers installed, the
plug-ins that listen to the events subscribed (the run index's :class:`~unbroken.run.index.recorder.Recorder`
and the SLURM submit script, on the coordinator of a writable run), and the writer process started.
``close()`` ends it in the reverse order, after waiting for a background save and the uploads. A
script that never closes is closed at exit (``unbroken._support.exithooks``); a session with a RAM tier is held
until then, so that its newest RAM checkpoint is persisted even if the Checkpointer was dropped.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from .._support.exithooks import at_process_exit
from ..faults import slurm
from ..faults.signals import SignalWatcher
from ..run.index.recorder import Recorder
from .core import Core
from .saving import Saver

log = logging.getLogger("unbroken")
_open: weakref.WeakSet[Session] = weakref.WeakSet()
_held: set[Session] = set()
"""Sessions with a RAM tier, held until closed: one whose Checkpointer was dropped without ``close()`` (a local
variable of ``main()``) must still persist its newest RAM checkpoint at exit, so it is not collected before."""


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) does not own its parent's sessions: its exit must not close them."""
    global _open, _held
    _open, _held = weakref.WeakSet(), set()


@at_process_exit(forget=_forget_in_child)
def _close_at_exit() -> None:
    """A script that never calls close(): wait for its uploads and release its lock/lease."""
    for each in list(_open):
        try:
            each.end(ended=False)  # (a crash, or a script that never closes: RAM kept, see unbroken.tiers.ram)
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.error("closing %s at exit failed: %s", each.core.location, e)


class Session:
    """Begins and ends a Checkpointer's time as its run's writer (see the module docstring)."""

    def __init__(self, core: Core, saver: Saver, signals: SignalWatcher) -> None:
        self.core, self.saver, self.signals = core, saver, signals
        self.plugins: list[Any] = []

    def begin(self) -> None:
        """Become this run's writer (idempotent): lock, clean leftovers, watch signals, plug in."""
        core = self.core
        if core.run.writing:
            return
        core.run.begin()
        _open.add(self)
        if core.run.ram is not None:
            _held.add(self)
        core.rules.watch_optimizers()  # which optimizers step, for the forgotten-optimizer warning
        self.signals.install()
        if core.comm.coordinator and not core.run.readonly:  # one index, one submit script per run
            core.recorder = Recorder(core.run.store)
            self.plugins = [core.recorder, slurm.SubmitScript(core.run.store.local_dir())]
        for p in self.plugins:
            core.events.subscribe(p)
        self.saver.writer_process()  # started before the first background save, off its stall

    def end(self, ended: bool) -> None:
        """Wait for a background save, release the run and restore the signal handlers; a failed
        background save is raised after all that. ``ended``: training ended normally (``close()``, a
        ``with`` block left without an exception), not a crash: only then is a RAM tier's folder removed."""
        core = self.core
        _open.discard(self)
        _held.discard(self)
        failed: BaseException | None = None
        try:
            self.saver.flush()
        except Exception as e:  # noqa: BLE001 - raised below, once the run is released
            failed = e
            log.error("the last background save failed: %s: %s", type(e).__name__, e)
        self.saver.close()
        self.signals.uninstall()
        core.rules.stop_watching()
        received = self.signals.received
        keep = (f"stopping on a signal ({received.name})" if received is not None
                else None if ended else "stopping without close() (an exception, or the exit of a script that never "
                                        "calls close())")
        core.run.close(keep_ram=keep)  # a relaunch here reads RAM
        core.comm.close()
        for p in self.plugins:
            core.events.unsubscribe(p)
        if core.recorder is not None:  # the segment ended in this process (a kill leaves no such event)
            how = "ended" if ended and failed is None else "stopped"
            core.recorder.event("closed", how, step=core.progress.step,
                                data={"signal": received.name if received is not None else None})
            core.recorder.close()
            core.recorder = None
        self.plugins = []
        if failed is not None:
            raise failed
