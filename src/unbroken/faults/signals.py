"""Signal handlers that only set a flag (DESIGN decision 7).

A handler runs between two Python bytecodes of the main thread, possibly in the
middle of a save or an optimizer step; doing real work there corrupts state. So the
handler records the signal and returns; :meth:`unbroken.Checkpointer.step` sees the
flag at the next step boundary, saves, and exits. The handler that was there before
is still called (chained). The same signal a second time, before the newest watcher
acted on the first, restores the previous handling and delivers the signal again:
pressing Ctrl-C twice aborts at once.

One process may hold several Checkpointers, opened and closed in any order, and a
Checkpointer may be left open. So the handlers are not stacked one per watcher (closing
out of order would reinstate a stale handler, or drop a live one); one process-wide
dispatcher owns each watched signal while any watcher is installed, marks every
installed watcher, and gives the signal back to the handling it found when the last
watcher leaves.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Any, Iterable

log = logging.getLogger("unbroken")
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_SIGCHLD = getattr(signal, "SIGCHLD", None)


class SignalWatcher:
    """Records the first of ``signals`` that arrives while installed (see the module docstring)."""

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> bool:
        """Start watching; returns False (and logs) off the main thread."""
        if self._installed or not self.signals:
            return self._installed
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: signal handlers not installed; preemption saves disabled")
            return False
        _dispatcher.add(self)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Stop watching; the last watcher of a signal gives it back to the handling it found."""
        if self._installed:
            self._installed = False
            _dispatcher.remove(self)

    def clear(self) -> None:
        self.received = self.received_at = None

    def _mark(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received, self.received_at = sig, time.monotonic()


class _Dispatcher:
    """The one handler of each watched signal; knows the handling it replaced."""

    def __init__(self) -> None:
        # In install order, the newest last. Weak: a Checkpointer dropped without close() stops
        # watching when it is collected, and is not kept alive by its handler.
        self._watchers: list[weakref.ref[SignalWatcher]] = []
        self.found: dict[signal.Signals, Any] = {}  # the handling before the dispatcher took a signal

    @property
    def watchers(self) -> list[SignalWatcher]:
        live = [w for w in (r() for r in self._watchers) if w is not None]
        if len(live) != len(self._watchers):
            self._watchers = [weakref.ref(w) for w in live]
        return live

    def add(self, w: SignalWatcher) -> None:
        self._watchers = [weakref.ref(x) for x in self.watchers] + [weakref.ref(w)]
        for s in w.signals:
            if s not in self.found or signal.getsignal(s) != self._handle:
                # not ours yet, or someone installed their own handler over ours since: theirs
                # is now the handling to chain to and to give back
                prev = signal.signal(s, self._handle)
                # our own handler, put back by someone who had saved it: the handling before it is
                # unknown (never chain to ourselves: that recursed)
                self.found[s] = signal.SIG_DFL if prev == self._handle else prev

    def remove(self, w: SignalWatcher) -> None:
        live = [x for x in self.watchers if x is not w]
        self._watchers = [weakref.ref(x) for x in live]
        still = {s for x in live for s in x.signals}
        if _SIGCHLD is not None and any(x.received for x in live):
            still.add(signal.Signals(_SIGCHLD))  # a preemption is still under way
        for s in [s for s in self.found if s not in still]:
            self._give_back(s)

    def _give_back(self, s: signal.Signals) -> None:
        prev = self.found.pop(s)
        try:
            if signal.getsignal(s) == self._handle:  # replaced after us by someone else: theirs now
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        except (ValueError, OSError):  # interpreter shutting down, or not the main thread
            pass

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        watching = [w for w in self.watchers if sig in w.signals]
        prev = self.found.get(sig)
        if prev is None or prev == self._handle:
            prev = signal.SIG_DFL
        if not watching or watching[-1].received == sig:  # a second time: stop waiting for a step boundary
            self.found.pop(sig, None)
            signal.signal(sig, prev)  # handlers run on the main thread: this cannot fail here
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:
                os.kill(os.getpid(), signum)
            return
        for w in watching:
            w._mark(sig)
        self._quiet_children()
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)

    def _quiet_children(self) -> None:
        """After a preemption signal, a DataLoader worker killed by the same signal (sent to the
        whole process group) must not raise in the main process mid-save: PyTorch's SIGCHLD
        handler does that. The save needs no worker; a dead one is still noticed by the next
        fetch (and the step guard turns that into an exact checkpoint and the preemption exit).
        SIGCHLD gets its handler back when the last watcher leaves."""
        if _SIGCHLD is not None and _SIGCHLD not in self.found:
            try:
                self.found[signal.Signals(_SIGCHLD)] = signal.signal(_SIGCHLD, signal.SIG_DFL)
            except (ValueError, OSError):
                pass


_dispatcher = _Dispatcher()


def describe(sig: signal.Signals | None) -> str:
    return sig.name if sig is not None else "none"
