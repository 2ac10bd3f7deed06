"""Preemption and failure handling: signals, exact emergency saves, SLURM.

- :mod:`.signals` — handlers that only set a flag; the save happens at the next step
  boundary on the main thread.
- :mod:`.guard` — ``Checkpointer.guard(state)``: an exception inside a step gives an
  exact emergency checkpoint (or none, logged, when no instant can be proven), then propagates.
- :mod:`.handlers` — what the Checkpointer does on a signal or an exception (public API only).
- :mod:`.slurm` — SLURM detection, requeue, and a ``submit.slurm`` that resubmits the job.
"""

from __future__ import annotations

from dataclasses import dataclass

from .signals import DEFAULT_SIGNALS

EXIT_PREEMPTED = 75
"""Exit status after a signal-triggered save (``EX_TEMPFAIL``: "try again later").

Non-zero so that ``torchrun --max-restarts`` and job schedulers see an unfinished run;
distinct from crashes (1) and from death by signal (128 + n)."""


@dataclass(frozen=True)
class Preemption:
    """How a :class:`~unbroken.Checkpointer` reacts to preemption signals.

    Args:
        signals: on these signals, save at the next ``step()`` and exit with
            :data:`EXIT_PREEMPTED` (default SIGTERM, SIGUSR1, SIGINT). A second identical
            signal acts at once.
        grace_period: seconds between the signal and the hard kill (e.g. SLURM's
            ``--signal=USR1@120``); a save that takes longer is warned about.
        requeue: after a signal-triggered save inside a SLURM job, ``scontrol requeue`` it.

    ``Checkpointer(..., preemption=None)`` leaves signals alone.
    """

    signals: tuple[int, ...] = tuple(DEFAULT_SIGNALS)
    grace_period: float | None = None
    requeue: bool = False
