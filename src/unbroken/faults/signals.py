"""Signal handlers that only set a flag (DESIGN decision 7), and when a repeat aborts.

A handler runs between two Python bytecodes of the main thread, possibly in the
middle of a save or an optimizer step; doing real work there corrupts state. So the
handler records the signal and returns; :meth:`unbroken.Checkpointer.step` sees the
flag at the next step boundary, saves, and exits. The handler that was there before
is still called (chained), for every delivery.

**One request, or an abort.** Schedulers and launchers deliver one preemption to a
worker several times within milliseconds: SLURM and Kubernetes signal every process
and torchrun forwards the SIGTERM it got to its workers. So a repeat of the same
signal within :data:`SAME_REQUEST_S` seconds of its first arrival is the same request:
nothing more happens. A repeat later is deliberate (Ctrl-C pressed again, a second
``kill``): the run aborts at once, also in the middle of the preemption save, without
a checkpoint: the handling found before unbroken takes over and receives the signal
(Python's default Ctrl-C handling, ``KeyboardInterrupt``, is replaced by the
system's: the process ends by SIGINT at once, since a ``KeyboardInterrupt`` can be
caught and turned into more work). Each signal counts on its own: SLURM's USR1 followed
by its SIGTERM at the time limit is not a repeat. Nothing is lost by the abort that a
SIGKILL would not lose: the interrupted save is never committed.

A preemption ends with ``close()`` and the exit; a straggling copy of the signal can
still arrive then. So the handler of a signal that arrived less than
:data:`SAME_REQUEST_S` seconds ago stays installed after the last watcher left, swallows
the copies arriving in that window and gives the signal back to the handling it found
at the first later delivery (or when a watcher is installed or removed).

One process may hold several Checkpointers, opened and closed in any order, and a
Checkpointer may be left open. So the handlers are not stacked one per watcher (closing
out of order would reinstate a stale handler, or drop a live one); one process-wide
dispatcher owns each watched signal while any watcher is installed, marks every
installed watcher, and gives the signal back to the handling it found when the last
watcher leaves.

Times are arrival times (:mod:`.arrivals`), not the handler's: a copy that arrived 20 ms after
the first while the main thread was busy in one long C call (waiting for the GPU) is handled
seconds later, and is still a copy.

Under torchrun the dispatcher also asks the kernel to signal the worker when its
launcher dies (:mod:`.launcher`): that signal takes the same path as a scheduler's.

**A process that ends with an uncaught exception stops watching.** No step boundary comes any
more, so a request can no longer be served, and a flag only keeps the process alive: when a
rank of a torchrun job dies, its peers fail in their next collective and the agent SIGTERMs
them; flagged, a survivor went on through the interpreter's finalization (a full garbage
collection of torch's modules, 1-4 s on a loaded machine, measured in
``benchmarks/bench_goodput.py``) before torchrun could restart the group, where without
unbroken the SIGTERM ends it at once. So at exit after an uncaught exception (``atexit``, registered
when the process first watches; after unbroken's exit hooks have closed the Checkpointers and waited
for their saves) every signal goes back to the handling found before unbroken, and a watched signal that arrived
unserved is delivered to it again: the process ends as it would have without unbroken, only
after closing. A normal exit and ``sys.exit`` (the preemption's exit 75) keep swallowing
straggling copies as above.

**A saved preemption exits with 75, whatever comes after.** Under torchrun, once the preemption
checkpoint is saved, the process ignores the watched signals and SIGTERM until it is gone: the agent
SIGTERMs every other rank the moment one rank exits, and a rank still closing, or still finalizing
its interpreter, would otherwise end by that signal (-15) instead of the preemption's 75. While the
Checkpointer closes, the handler swallows them (at most :data:`EXITING_S`); once it is closed they
are set to ``SIG_IGN`` (Python gives its handlers' signals the default handling back while it
finalizes, which a Python handler cannot prevent). Nothing is lost by ignoring them: the checkpoint
is committed, and the agent sends SIGKILL if the exit takes too long.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import Any

from . import launcher
from .arrivals import Arrivals
from .watchable import CHILD_SIGNAL as _SIGCHLD

log = logging.getLogger("unbroken")

SAME_REQUEST_S = 2.0
"""A repeat of a watched signal within this many seconds of its first arrival is the same
request (schedulers and torchrun deliver one preemption several times within milliseconds);
a repeat later aborts the run at once."""

EXITING_S = 30.0
"""After its preemption checkpoint is saved, a process exiting with 75 ignores the watched signals and
SIGTERM for this long: torchrun's agent SIGTERMs every other rank as soon as one has exited, and a rank
still closing (its process group, its writer, its logs) would otherwise end by that SIGTERM instead of
75. The agent itself sends SIGKILL 30 s after its SIGTERM."""

class SignalWatcher:
    """Records the first of ``signals`` that arrives while installed (see the module docstring)."""

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self.first: dict[signal.Signals, float] = {}  # when each signal first arrived
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
        self.first.clear()

    def _mark(self, sig: signal.Signals, now: float) -> None:
        self.first.setdefault(sig, now)
        if self.received is None:
            self.received, self.received_at = sig, now


class _Dispatcher:
    """The one handler of each watched signal; knows the handling it replaced."""

    def __init__(self) -> None:
        # In install order, the newest last. Weak: a Checkpointer dropped without close() stops
        # watching when it is collected, and is not kept alive by its handler.
        self._watchers: list[weakref.ref[SignalWatcher]] = []
        self.found: dict[signal.Signals, Any] = {}  # the handling before the dispatcher took a signal
        # signals whose last watcher left less than SAME_REQUEST_S after their first arrival: their
        # straggling copies are swallowed (see the module docstring); signal -> first arrival
        self.lingering: dict[signal.Signals, float] = {}
        self._pid = os.getpid()  # whose watchers the handlers serve (taken at the first add: a child forked later,
        self._exit_pid = 0  # a DataLoader worker, stays quiet); the process that registered the exit step-aside
        self.arrivals = Arrivals()  # when signals arrived (their handler may run seconds later)
        self.handled: dict[signal.Signals, float] = {}  # when the handler last ran, per signal
        self.requested: set[signal.Signals] = set()  # arrived while watched, since the newest watcher came
        self.exiting_until = 0.0  # a preemption saved: until then, the process is exiting with 75
        self.ignoring: set[signal.Signals] = set()  # set to SIG_IGN for the exit (see ignore_until_exit)

    @property
    def watchers(self) -> list[SignalWatcher]:
        live = [w for w in (r() for r in self._watchers) if w is not None]
        if len(live) != len(self._watchers):
            self._watchers = [weakref.ref(w) for w in live]
        return live

    def add(self, w: SignalWatcher) -> None:
        if not self.found and not self._watchers:
            self._pid = os.getpid()
        if self._exit_pid != os.getpid():  # plain atexit, after the hooks that close the Checkpointers; at the first
            atexit.register(_step_aside_at_exit)  # watch, not the import (a fork server's): before earlier handlers
            self._exit_pid = os.getpid()
        self._watchers = [weakref.ref(x) for x in self.watchers] + [weakref.ref(w)]
        self.requested.clear()  # a new run: what arrived before was served (or the run abandoned)
        self.exiting_until = 0.0  # (a process that caught the preemption's SystemExit and trains again)
        for s in self.ignoring:
            if signal.getsignal(s) == signal.SIG_IGN:
                signal.signal(s, self._handle)  # ours again; self.found keeps the handling found before
        self.ignoring.clear()
        for s in w.signals:
            self.lingering.pop(s, None)  # a new run watches it: its next arrival is a new request
            if s not in self.found or signal.getsignal(s) != self._handle:
                # not ours yet, or someone installed their own handler over ours since: theirs
                # is now the handling to chain to and to give back
                prev = signal.signal(s, self._handle)
                # our own handler, put back by someone who had saved it: the handling before it is
                # unknown (never chain to ourselves: that recursed)
                self.found[s] = signal.SIG_DFL if prev == self._handle else prev
        self._settle(fresh=w.signals)

    def remove(self, w: SignalWatcher) -> None:
        live = [x for x in self.watchers if x is not w]
        self._watchers = [weakref.ref(x) for x in live]
        still = {s for x in live for s in x.signals}
        now = time.monotonic()
        for s, t in w.first.items():  # a preemption is ending: copies of its signal may still come
            if s not in still and s in self.found and now - t <= SAME_REQUEST_S:
                self.lingering[s] = min(t, self.lingering.get(s, t))
        self._settle(live)

    def _settle(self, live: list[SignalWatcher] | None = None, fresh: Iterable[int] = ()) -> None:
        """Give back what no watcher needs any more; keep the launcher watch in step with the watchers."""
        live = self.watchers if live is None else live
        now = time.monotonic()
        for s in [s for s, t in self.lingering.items() if now - t > SAME_REQUEST_S]:
            del self.lingering[s]
        still = {s for x in live for s in x.signals} | set(self.lingering)
        if now < self.exiting_until:
            still |= set(self.found)  # kept until the process is gone (see exiting())
        if _SIGCHLD is not None and any(x.received for x in live):
            still.add(signal.Signals(_SIGCHLD))  # a preemption is still under way
        for s in [s for s in self.found if s not in still]:
            self._give_back(s)
        if live or self.lingering:
            self.arrivals.start()
        else:
            self.arrivals.stop()
        self.arrivals.own(self._owned(), fresh)
        launcher.watch(self._launcher_signal(live))

    @staticmethod
    def _launcher_signal(live: list[SignalWatcher]) -> signal.Signals | None:
        """The signal a dead launcher sends: SIGTERM if watched, else the newest watcher's first."""
        watched = [s for x in live for s in x.signals]
        if signal.SIGTERM in watched:
            return signal.SIGTERM
        return live[-1].signals[0] if live and live[-1].signals else None

    def _give_back(self, s: signal.Signals) -> None:
        prev = self.found.pop(s)
        self.lingering.pop(s, None)
        try:
            if signal.getsignal(s) == self._handle:  # replaced after us by someone else: theirs now
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        except (ValueError, OSError):  # interpreter shutting down, or not the main thread
            pass

    def _previous(self, sig: signal.Signals) -> Any:
        prev = self.found.get(sig)
        return signal.SIG_DFL if prev is None or prev == self._handle else prev

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        # arrivals since the last handling: several if they came while the main thread was busy in C
        arrived = self.arrivals.take(sig, self.handled.get(sig, float("-inf"))) or [now]
        self.handled[sig] = now
        if now < self.exiting_until:  # the preemption is saved, the process on its way out with 75
            if os.getpid() == self._pid:
                log.warning("%s while exiting after the preemption checkpoint: ignored, the process exits with "
                            "the preemption's status", sig.name)
            return
        watching = [w for w in self.watchers if sig in w.signals]
        prev = self._previous(sig)
        if not watching:  # the run closed: a straggling copy of its preemption, or the handling found
            first = self.lingering.get(sig)
            if first is None or arrived[-1] - first > SAME_REQUEST_S:
                self._deliver(sig, prev, frame)
            elif callable(prev) and prev is not signal.default_int_handler:
                prev(signum, frame)
            return
        first = watching[-1].first.get(sig)
        if first is not None and arrived[-1] - first > SAME_REQUEST_S:  # deliberate: abort now
            self._abort(sig, arrived[-1] - first, prev, frame)
            return
        mine = os.getpid() == self._pid
        if first is None:
            if mine:
                self.requested.add(sig)
            for w in watching:
                w._mark(sig, arrived[0])
            self._quiet_children()
            if mine:
                cause = " (the launcher died)" if launcher.died() else ""
                log.warning("%s received%s: saving at the end of this step, then exiting; the same signal "
                            "again more than %.0f s later aborts at once, without a checkpoint", sig.name, cause,
                            SAME_REQUEST_S)
        elif mine:
            log.info("%s again %.3f s after the first: the same request (repeats within %.0f s are)", sig.name,
                     arrived[-1] - first, SAME_REQUEST_S)
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)

    def _abort(self, sig: signal.Signals, after: float, prev: Any, frame: FrameType | None) -> None:
        """A deliberate repeat: the handling found before unbroken takes over now, and gets the signal.
        Python's KeyboardInterrupt can be caught (by a step guard writing an emergency checkpoint, by
        the script): the system's default ends the process at once, as Ctrl-C twice promises."""
        if os.getpid() == self._pid:
            log.warning("%s again %.1f s after the first: aborting now, without a checkpoint (the run resumes "
                        "from its last committed one)", sig.name, after)
        self._deliver(sig, signal.SIG_DFL if prev is signal.default_int_handler else prev, frame)

    def exiting(self, seconds: float, also: Iterable[signal.Signals]) -> None:
        """A preemption saved its checkpoint and the process exits with 75: for ``seconds``, every
        delivery of a watched signal or of ``also`` is ignored (see :data:`EXITING_S`). Main thread only."""
        if os.getpid() != self._pid or threading.current_thread() is not threading.main_thread():
            return
        self.exiting_until = time.monotonic() + seconds
        for s in also:
            if s not in self.found:
                prev = signal.signal(s, self._handle)
                self.found[s] = signal.SIG_DFL if prev == self._handle else prev
        self.arrivals.own(self._owned())

    def ignore_until_exit(self) -> None:
        """The Checkpointers are closed and the process exits with 75 now: the signals this dispatcher
        handles are ignored by the kernel from here on. A Python handler would not do: the interpreter
        gives the default handling back while it finalizes (a second or more with torch loaded), and
        torchrun's SIGTERM then ends the process with -15. Main thread only."""
        if os.getpid() != self._pid or threading.current_thread() is not threading.main_thread():
            return
        for s in list(self.found):
            if s != _SIGCHLD and signal.getsignal(s) == self._handle:
                signal.signal(s, signal.SIG_IGN)
                self.ignoring.add(s)

    def step_aside(self) -> None:
        """The process is ending after an uncaught exception: every signal back to the handling found
        before unbroken, and a watched signal that arrived unserved delivered to it again (see the
        module docstring). Main thread only; never in a forked child."""
        if os.getpid() != self._pid or threading.current_thread() is not threading.main_thread():
            return
        pending = sorted(self.requested)
        self.requested.clear()
        self._watchers = []
        self.lingering.clear()
        for s in list(self.found):
            self._give_back(s)
        self.arrivals.stop()
        launcher.watch(None)
        for s in pending:
            prev = signal.getsignal(s)  # the handling found before unbroken, given back
            if prev is signal.default_int_handler:  # a KeyboardInterrupt now would only be printed
                signal.signal(s, signal.SIG_DFL)
                prev = signal.SIG_DFL
            if prev == signal.SIG_IGN or prev is None:
                continue
            log.info("%s arrived while the process was failing: ending as it would have without unbroken", s.name)
            if callable(prev):
                prev(int(s), None)
            else:
                os.kill(os.getpid(), s)

    def _owned(self) -> set[signal.Signals]:
        return {s for s in self.found if s != _SIGCHLD}

    def _deliver(self, sig: signal.Signals, prev: Any, frame: FrameType | None) -> None:
        self.found.pop(sig, None)
        self.lingering.pop(sig, None)
        self.arrivals.own(self._owned())
        signal.signal(sig, prev)  # handlers run on the main thread: this cannot fail here
        if callable(prev):
            prev(int(sig), frame)
        elif prev != signal.SIG_IGN:
            os.kill(os.getpid(), sig)

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


def _under_torchrun() -> bool:
    """A worker of torchrun's agent, which SIGTERMs every other worker once one has exited."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def exiting_after_preemption(seconds: float = EXITING_S) -> None:
    """Under torchrun, the preemption checkpoint is saved and the process is about to close and exit with
    75: ignore the watched signals and SIGTERM from now on (the Checkpointer's close included, at most
    ``seconds``, :data:`EXITING_S`); :func:`closed_for_exit` then hands them to the kernel to ignore.
    Elsewhere nothing signals a process that is exiting, and a caller that catches the ``SystemExit``
    (a notebook) keeps its signals as they were."""
    if _under_torchrun():
        _dispatcher.exiting(seconds, (signal.SIGTERM,))


def closed_for_exit() -> None:
    """After :func:`exiting_after_preemption` and the close, under torchrun: the kernel ignores those
    signals until the process is gone (its interpreter's finalization included)."""
    if _under_torchrun():
        _dispatcher.ignore_until_exit()


def _step_aside_at_exit() -> None:
    """``atexit``: after an uncaught exception (Python has set ``sys.last_value``; not for
    ``sys.exit``), stop watching and deliver an unserved request (see the module docstring)."""
    if getattr(sys, "last_value", None) is not None:
        _dispatcher.step_aside()


def describe(sig: signal.Signals | None) -> str:
    return sig.name if sig is not None else "none"
