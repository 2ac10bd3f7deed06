"""Signal handlers that only set a flag (DESIGN decision 7).

A handler runs between two Python bytecodes of the main thread, possibly in the
middle of a save or an optimizer step; doing real work there corrupts state. So the
handler records the signal and returns; :meth:`unbroken.Checkpointer.step` sees the
flag at the next step boundary, saves, and exits. A previous Python handler is still
called (chained). The same signal a second time restores the previous handling and
delivers the signal again: pressing Ctrl-C twice aborts at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Iterable

log = logging.getLogger("unbroken")
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class SignalWatcher:
    """Installs flag-setting handlers for ``signals`` while installed."""

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handlers; returns False (and logs) off the main thread."""
        if self.installed or not self.signals:
            return self.installed
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: signal handlers not installed; preemption saves disabled")
            return False
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return True

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            try:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):  # interpreter shutting down, or not main thread
                pass
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        prev = self._previous.get(sig)
        if self.received == sig:  # second time: stop waiting for a step boundary
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        self.received, self.received_at = sig, time.monotonic()
        self._quiet_children()
        if callable(prev) and prev not in (signal.default_int_handler,):
            prev(signum, frame)

    def _quiet_children(self) -> None:
        """After a preemption signal, a DataLoader worker killed by the same signal (sent to the
        whole process group) must not raise in the main process mid-save: PyTorch's SIGCHLD
        handler does that. The save needs no worker; a dead one is still noticed by the next
        fetch (and the step guard turns that into an exact checkpoint and the preemption exit)."""
        sigchld = getattr(signal, "SIGCHLD", None)
        if sigchld is not None and sigchld not in self._previous:
            try:
                self._previous[sigchld] = signal.signal(sigchld, signal.SIG_DFL)
            except (ValueError, OSError):
                pass

    def clear(self) -> None:
        self.received = self.received_at = None


def describe(sig: signal.Signals | None) -> str:
    return sig.name if sig is not None else "none"

