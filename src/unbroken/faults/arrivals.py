"""When signals arrived, as opposed to when their Python handler ran.

A Python signal handler runs on the main thread between two bytecodes. While the main thread
is inside one long C call (waiting for the GPU in ``loss.item()``, a large CPU operation) a
signal that arrived at once is handled seconds later. The rule that tells a copy of a
preemption from a deliberate repeat (:mod:`.signals`) compares arrival times, so it needs
them: Python's C-level handler writes each signal's number to the *wakeup fd*
(``signal.set_wakeup_fd``) the moment it arrives, and a daemon thread blocked on that pipe
takes the time (torch releases the GIL in its long calls, so the thread runs then).

The wakeup fd is process-wide: it is taken only if nobody else holds it (asyncio takes it for
``loop.add_signal_handler``), and given back when the last watcher leaves; only the signals the
dispatcher handles are recorded. A handler that runs before the thread saw its delivery waits
for it a few milliseconds; without the wakeup fd the arrival time is the handler's time. The
pipe and its thread are made once per process and kept (closing the pipe could race a signal
writing to a reused descriptor): two descriptors and an idle thread, nothing per step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable

_KEEP = 16  # arrival times kept per signal
_WAIT = 0.05  # how long a handler waits for the thread to see its delivery


class Arrivals:
    """Arrival times of the signals that have a Python handler, while :meth:`start` ed."""

    def __init__(self) -> None:
        self._pid = -1
        self._write = -1
        self._times: dict[int, list[float]] = {}
        self._owned: frozenset[int] = frozenset()  # signals whose handler is the dispatcher's
        # re-entrant: a handler may run while the main thread holds it (in own())
        self._cond = threading.Condition(threading.RLock())
        self.active = False

    def start(self) -> None:
        """Take the wakeup fd if it is free (main thread only); idempotent."""
        if self.active:
            return
        if self._pid != os.getpid():  # first use in this process (a forked child has no reader thread)
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._pid, self._write, self._times = os.getpid(), w, {}
            threading.Thread(target=self._read, args=(r,), name="unbroken-signal-arrivals", daemon=True).start()
            os.register_at_fork(after_in_child=self._forked)
        try:
            old = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread
            return
        if old != -1:  # someone else's: leave it to them
            signal.set_wakeup_fd(old)
            return
        self.active = True

    def stop(self) -> None:
        """Give the wakeup fd back (unless someone took it over since)."""
        if not self.active:
            return
        self.active = False
        try:
            current = signal.set_wakeup_fd(-1)
            if current != self._write:
                signal.set_wakeup_fd(current)
        except (ValueError, OSError):
            pass

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): its signals are not the parent's arrivals."""
        if self.active and self._pid != os.getpid():
            self.active = False
            try:
                signal.set_wakeup_fd(-1)
            except (ValueError, OSError):
                pass

    def own(self, signals: Iterable[int], fresh: Iterable[int] = ()) -> None:
        """Record only ``signals`` (a delivery to someone else's handler also writes to the wakeup
        fd, and no handler of ours would take it); forget what was recorded for ``fresh``."""
        with self._cond:
            self._owned = frozenset(int(s) for s in signals)
            for s in [s for s in self._times if s not in self._owned]:
                del self._times[s]
            for s in fresh:
                self._times.pop(int(s), None)

    def take(self, sig: int, after: float) -> list[float]:
        """For the handler of ``sig``: the arrivals later than ``after`` (the previous handling),
        oldest first, forgotten then. The thread may not have seen this delivery yet (the main
        thread was quicker): it is given :data:`_WAIT` seconds. Empty if it did not come."""
        with self._cond:
            deadline = time.monotonic() + _WAIT
            while self.active and not any(t > after for t in self._times.get(sig, ())):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            times = self._times.pop(sig, [])
        return [t for t in times if t > after]

    def _read(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 1024)
            except OSError:
                return
            if not data:
                return
            now = time.monotonic()
            with self._cond:
                for sig in data:
                    if sig in self._owned:
                        kept = self._times.setdefault(sig, [])
                        kept.append(now)
                        del kept[:-_KEEP]
                self._cond.notify_all()
