"""Preemption and failure handling: signals, exact emergency saves, SLURM.

- :mod:`.signals` — handlers that only set a flag; the save happens at the next step
  boundary on the main thread; a repeat within seconds is the same request, later it aborts.
- :mod:`.launcher` — a torchrun worker whose launcher died is signalled like a preempted one.
- :mod:`.guard` — ``Checkpointer.guard(state)``: an exception inside a step gives an
  exact emergency checkpoint (or none, logged, when no instant can be proven), then propagates.
- :mod:`.handlers` — what the Checkpointer does on a signal or an exception (public API only).
- :mod:`.slurm` — SLURM detection, requeue, and a ``submit.slurm`` that resubmits the job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigurationError
from .watchable import DEFAULT_SIGNALS, check_signals

EXIT_PREEMPTED = 75
"""Exit status after a signal-triggered save (``EX_TEMPFAIL``: "try again later").

Non-zero so that ``torchrun --max-restarts`` and job schedulers see an unfinished run;
distinct from crashes (1) and from death by signal (128 + n)."""


@dataclass(frozen=True)
class Preemption:
    """How a :class:`~unbroken.Checkpointer` reacts to preemption signals.

    Args:
        signals: on these signals, save at the next ``step()`` and exit with
            :data:`EXIT_PREEMPTED` (default SIGTERM, SIGUSR1, SIGINT). The same signal again
            within :data:`~unbroken.faults.signals.SAME_REQUEST_S` seconds (2) of its first
            arrival is the same request (a scheduler and torchrun both deliver it); again
            later, e.g. Ctrl-C pressed a second time, it aborts at once, also during the
            preemption save, without a checkpoint. Under torchrun, a worker whose launcher
            died is sent SIGTERM (the first signal if SIGTERM is not watched).
        grace_period: seconds between the signal and the hard kill (e.g. SLURM's
            ``--signal=USR1@120``); a save that takes longer is warned about.
        requeue: after a signal-triggered save inside a SLURM job, ``scontrol requeue`` it.

    ``Checkpointer(..., preemption=None)`` leaves signals alone. Every argument is checked
    here: a signal that cannot be watched (SIGKILL, SIGSTOP, a fault such as SIGSEGV, SIGCHLD,
    an unknown number, one listed twice), a grace period that is not a positive number of
    seconds, or a ``requeue`` that is not a bool raises
    :class:`~unbroken.errors.ConfigurationError`.
    """

    signals: tuple[int, ...] = tuple(DEFAULT_SIGNALS)
    grace_period: float | None = None
    requeue: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", check_signals(self.signals))
        g = self.grace_period
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g)
                              or g <= 0):
            raise ConfigurationError(f"Preemption(grace_period={g!r}): pass the seconds between the signal and "
                                     "the hard kill as a positive number (e.g. 120 for --signal=USR1@120), or "
                                     "None if unknown")
        if not isinstance(self.requeue, bool):
            raise ConfigurationError(f"Preemption(requeue={self.requeue!r}): pass True or False")
