"""Which signals a :class:`~unbroken.Preemption` may watch (its constructor checks them here), and the
ones it watches by default. What happens when one arrives is :mod:`.signals`."""

from __future__ import annotations

import signal
from typing import Any

from ..errors import ConfigurationError

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CHILD_SIGNAL = getattr(signal, "SIGCHLD", None)
"""SIGCHLD where the system has it: reports a child that ended, never a preemption."""
_UNCATCHABLE = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}
_FAULTS = {getattr(signal, n) for n in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGABRT", "SIGSYS")
           if hasattr(signal, n)}


def check_signals(signals: Any) -> tuple[signal.Signals, ...]:
    """The signals a :class:`~unbroken.Preemption` may watch, as ``signal.Signals``, or a
    :class:`~unbroken.errors.ConfigurationError` that names the one refused and why."""
    if isinstance(signals, (int, str, bytes)) or not hasattr(signals, "__iter__"):
        raise ConfigurationError(f"Preemption(signals={signals!r}): pass a tuple of signals, e.g. "
                                 "signals=(signal.SIGTERM, signal.SIGUSR1), or () to watch none")
    out: list[signal.Signals] = []
    for s in signals:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ConfigurationError(f"Preemption(signals=...): {s!r} is not a signal; use the constants of the "
                                     "signal module, e.g. signal.SIGTERM")
        try:
            sig = signal.Signals(s)
        except ValueError:
            raise ConfigurationError(f"Preemption(signals=...): {s} is not a signal number of this system "
                                     "(see signal.valid_signals())") from None
        if sig in _UNCATCHABLE:
            raise ConfigurationError(f"Preemption(signals=...): {sig.name} cannot be caught, so no checkpoint "
                                     "can be saved on it; watch SIGTERM or SIGUSR1 instead (what schedulers "
                                     "send before they kill)")
        if sig in _FAULTS:
            raise ConfigurationError(f"Preemption(signals=...): {sig.name} reports a fault of the process itself "
                                     "(a handler that returns runs into it again); it cannot be watched")
        if sig == CHILD_SIGNAL:
            raise ConfigurationError("Preemption(signals=...): SIGCHLD reports a child process that ended (a "
                                     "DataLoader worker), not a preemption; it cannot be watched")
        if sig in out:
            raise ConfigurationError(f"Preemption(signals=...): {sig.name} is listed twice; list each signal once")
        out.append(sig)
    return tuple(out)
