"""What the Checkpointer does when a signal arrived or a step raised.

``self`` is the :class:`unbroken.Checkpointer`; these are its methods, kept here so the
manager stays one concept (the run) and this module the other (the failure paths).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping
from typing import Any

from . import EXIT_PREEMPTED, slurm
from .guard import StepGuard

log = logging.getLogger("unbroken")


def preempt_and_exit(self: Any, state: Mapping[str, Any]) -> None:
    """Save (unless just saved), log the timing against the grace period, requeue, exit 75."""
    sig = self._signals.received
    assert sig is not None and self._signals.received_at is not None
    waited = time.monotonic() - self._signals.received_at
    t0 = time.monotonic()
    if self._last_saved is None or self._last_saved[0] != self.progress.step:
        self.save(state, kind="preemption")
    took = time.monotonic() - t0
    budget = f" of the {self.grace_period:.0f} s grace period" if self.grace_period else ""
    log.warning("%s received: finished step %d %.1f s later, saved in %.1f s%s; exiting with %d",
                signal.Signals(sig).name, self.progress.step, waited, took, budget, EXIT_PREEMPTED)
    if self.grace_period and waited + took > self.grace_period:
        log.error("the preemption save ended %.1f s after the signal, past the %.0f s grace period: "
                  "ask the scheduler for a longer warning (e.g. --signal=USR1@%d)",
                  waited + took, self.grace_period, int(2 * (waited + took)) + 30)
    print(f"preempted at step {self.progress.step}", flush=True)
    self._record("event", "preempted", signal.Signals(sig).name, step=self.progress.step,
                 checkpoint=self._last_saved[1] if self._last_saved else None,
                 data={"waited_s": waited, "save_s": took, "grace_period_s": self.grace_period,
                       "requeue": self.requeue})
    if self.requeue:
        slurm.requeue()
    self.close()
    raise SystemExit(EXIT_PREEMPTED)

def emergency_save(self: Any, guard: StepGuard, exc: BaseException | None) -> Any:
    """The exact emergency checkpoint after a step raised (see :mod:`unbroken.faults.guard`)."""
    what = f"{type(exc).__name__}: {exc}" if exc is not None else "an exception"
    if guard.stepped:
        self.progress.step += 1
        self.progress.micro_step = 0
        info = self.save(guard.state, kind="emergency")
        log.error("step %d raised %s after the optimizer stepped; emergency checkpoint of the "
                  "post-step state: %s",
                  self.progress.step, what, info.name)
        return info
    start = guard.start
    assert start is not None
    if self._last_saved is not None and self._last_saved[0] == start.progress["step"]:
        log.error("step %d raised %s; no emergency checkpoint needed: %s already holds the state "
                  "at its start",
                  start.progress["step"] + 1, what, self._last_saved[1])
        return None
    info = self._write(start.rebuild(guard.state), start.progress, start.rng, kind="emergency")
    log.error("step %d raised %s; emergency checkpoint of the state at its start: %s "
              "(resuming re-runs the step)",
              start.progress["step"] + 1, what, info.name)
    return info
