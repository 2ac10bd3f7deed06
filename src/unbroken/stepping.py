"""The step boundary of the :class:`~unbroken.Checkpointer`: ``step()`` and ``end_epoch()``.

:class:`Stepping` is a part of the Checkpointer kept in its own module (the class inherits it,
as it does :class:`~unbroken.saving.Saving`): its methods use the Checkpointer's own state (the
progress, the schedule, the signal watcher, the step agreement of the ranks, the guard), which
:mod:`unbroken.manager` sets up. At a step boundary the progress moves on as one transition,
the ranks agree (:mod:`unbroken.agreement`) on saving, preemption and a loss spike, and the
Checkpointer saves, rolls back (:mod:`unbroken.recovery`) or stops with exit code 75.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import recovery
from .adapting import adapt
from .agreement import SAVE, SIGNAL, SPIKE
from .api import CheckpointInfo
from .events import StepEnded
from .faults.handlers import preempt_and_exit
from .policies import Trigger
from .restoring import sync_data_position
from .state.checks import clean_metrics


class Stepping:
    """The step boundary of :class:`~unbroken.Checkpointer` (see the module docstring)."""

    def step(self, state: Mapping[str, Any], **metrics: Any) -> CheckpointInfo | None:
        """Mark one optimizer step done; save if it is due. Metrics go into the manifest.

        If a watched signal arrived, save now (if not just saved) and exit with
        :data:`~unbroken.faults.EXIT_PREEMPTED` (``SystemExit``, so ``finally`` blocks run).
        With several ranks, a signal and a time trigger take effect one step later, on every
        rank at the same step: they are agreed in the background of the next step, without a
        blocking collective (:mod:`unbroken.agreement`).
        """
        state = adapt(state)
        self._begin()
        if self.run.readonly:  # fail at the first step, not after a save interval of lost compute
            self.run.require_writable("train and save into")
        if self._background.finished() and self.comm.world == 1:
            self.flush()  # a failed background save is raised here (several ranks: at the next save)
        # The step boundary is one transition: everything that can fail is computed first.
        clean = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        sync_data_position(self.progress, state)
        after = {**self.progress.state_dict(), "step": self.progress.step + 1, "micro_step": 0}
        start = self._guard.prepare(after) if self._guard is not None else None
        self.progress.step, self.progress.micro_step = after["step"], 0
        if self._guard is not None:
            self._guard.mark(start)
        self.metrics.update(clean)  # tensors stay tensors (no .item(): no GPU sync per step)
        self.events.publish(StepEnded(self.progress.step, clean))
        if self._selftest is not None:  # the step's fingerprint, before any save (same instant in every run)
            self._selftest.step_ended(self, state, clean)
        # the ranks agree on saving, preemption and a loss spike (unbroken.agreement): time triggers and signals
        # one step later, without waiting; rollback_if and metric triggers at once; nothing at world size 1
        policy = self._recovery if self._recovery is not None and self._recovery.rollback_if is not None else None
        due = lambda triggers: self._due(epoch_end=False, triggers=triggers)  # noqa: E731
        spike = policy.spiked(clean) if policy is not None else None
        at_once = self._selftest is not None  # its planned SIGTERM saves the very step planned
        flags = self._agreement.at_step(due, self._signals.received is not None, spike, at_once)
        if flags & SPIKE:  # before this step is saved: recover() rolls back to an earlier checkpoint
            raise recovery.LossSpike(self.progress.step, clean, here=bool(spike))
        info = self.save(state) if flags & SAVE else None
        if flags & SIGNAL:
            sig = self._signals.received or signal.SIGTERM  # a peer's signal: stop at the same step
            self.flush(raise_errors=False)
            preempt_and_exit(self, state, sig, self._signals.received_at or time.monotonic())
        self._agreement.after_step(due, self._signals.received is not None, at_once or policy is not None)
        if self._selftest is not None:
            self._selftest.after_step(self)  # a planned interruption or stop (SystemExit(0) after step N)
        return info

    def end_epoch(self, state: Mapping[str, Any], **metrics: Any) -> CheckpointInfo | None:
        """The epoch ends: call it last in the epoch, after its evaluation and ``scheduler.step()``
        (:meth:`epochs` does), passing the evaluation's metrics. ``progress.epoch`` moves on if the
        batch loop did not move it (it broke off, or there is none), every ``ResumableLoader`` in
        the state starts the new epoch, and this instant is saved if a trigger asks
        (``AtEpochEnd()``, ``OnImprovement("val_loss")``) or a preemption signal arrived during
        the epoch-end work (then the process exits with 75). Does not advance the step."""
        state = adapt(state)
        self._begin()
        self.metrics.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()})
        self._epoch_loop.close(state)
        if self._guard is not None:  # the next step starts from here, not from the epoch's last step
            self._guard.mark(self._guard.prepare(self.progress.state_dict()))
        # at once (blocking, once per epoch), with what the last step started agreeing on (unbroken.agreement)
        flags = self._agreement.now((SAVE if self._due(epoch_end=True) else 0)
                                    | (SIGNAL if self._signals.received else 0))
        info = self.save(state, kind="regular" if flags & SAVE else "preemption") if flags else None
        if flags & SIGNAL:  # saved above; preempt_and_exit finds this step saved and exits with 75
            self.flush(raise_errors=False)
            preempt_and_exit(self, state, self._signals.received or signal.SIGTERM,
                             self._signals.received_at or time.monotonic())
        return info

    def _due(self, epoch_end: bool, triggers: Sequence[Trigger] | None = None) -> bool:
        sched = self.schedule
        if not sched.due(self.progress.step, self.progress.epoch, epoch_end, self.metrics, triggers):
            return False
        return not sched.already_saved(self.progress.step, clean_metrics(self.metrics), self.progress.epoch)
