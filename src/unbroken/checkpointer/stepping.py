"""The step boundary of the :class:`~unbroken.Checkpointer`: ``step()`` and ``end_epoch()``.

:class:`Stepper` is the Checkpointer's part that ends steps and epochs: built with the
:class:`~unbroken.checkpointer.core.Core` the parts share, the :class:`~unbroken.checkpointer.saving.Saver`, the
signal watcher
and the epoch loop, it owns the step agreement of the ranks, and holds the step guard and the
``recover()`` policy while they are active. At a step boundary the progress moves on as one
transition, the ranks agree (:mod:`unbroken.checkpointer.agreement`) on saving, preemption and a loss spike, and
the Checkpointer saves, rolls back (:mod:`unbroken.faults.recovery`) or stops with exit code 75.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..api import CheckpointInfo
from ..events import StepEnded
from ..faults import recovery
from ..faults.guard import StepGuard
from ..faults.handlers import preempt_and_exit
from ..faults.signals import SignalWatcher
from ..policies import Trigger
from ..run.index.goodput import failure_history, lost_save_history
from ..state.checks import clean_metrics
from .agreement import SAVE, SIGNAL, SPIKE, StepAgreement
from .core import Core
from .epochs import EpochLoop
from .restoring import sync_data_position
from .saving import Saver

log = logging.getLogger("unbroken")

if TYPE_CHECKING:
    from ..selftest.hooks import Hooks
    from .manager import Checkpointer


class Stepper:
    """The step boundary of :class:`~unbroken.Checkpointer` (see the module docstring). Its calls take
    the Checkpointer itself only to hand it on: to the preemption exit and the selftest's hooks, which
    work through its public methods."""

    def __init__(self, core: Core, saver: Saver, signals: SignalWatcher, epoch_loop: EpochLoop) -> None:
        self.core, self.saver, self.signals, self.epoch_loop = core, saver, signals, epoch_loop
        triggers = core.schedule.trigger.triggers if core.schedule.trigger else ()
        self.agreement = StepAgreement(core.comm, triggers, watches_signals=bool(core.preemption.signals))
        self.guard: StepGuard | None = None
        """The active ``ckpt.guard(state)``, if any: marked at every step boundary."""
        self.recovery: recovery.Policy | None = None
        """Inside ``recover()``: its policy (the loss-spike predicate)."""
        self._history_of: int | None = None  # the segment whose failure history save_every="auto" has
        self.selftest: Hooks | None = None
        """``unbroken selftest``: its per-step hooks (``None`` otherwise: one attribute check per step)."""

    def step(self, ckpt: Checkpointer, state: Mapping[str, Any], metrics: Mapping[str, Any]) -> CheckpointInfo | None:
        """:meth:`unbroken.Checkpointer.step` once the state is adapted and the run open (see there)."""
        core = self.core
        if core.run.readonly:  # fail at the first step, not after a save interval of lost compute
            core.run.require_writable("train and save into")
        if self.saver.background.finished() and core.comm.world == 1:
            self.saver.flush()  # a failed background save is raised here (several ranks: at the next save)
        # The step boundary is one transition: everything that can fail is computed first.
        clean = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        progress = core.progress
        sync_data_position(progress, state)
        after = {**progress.state_dict(), "step": progress.step + 1, "micro_step": 0}
        start = self.guard.prepare(after) if self.guard is not None else None
        progress.step, progress.micro_step = after["step"], 0
        if self.guard is not None:
            self.guard.mark(start)
        core.metrics.update(clean)  # tensors stay tensors (no .item(): no GPU sync per step)
        core.events.publish(StepEnded(progress.step, clean))
        if self.selftest is not None:  # the step's fingerprint, before any save (same instant in every run)
            self.selftest.step_ended(ckpt, state, clean)
        if core.schedule.auto or (core.run.ram is not None and core.run.ram.auto is not None):
            self._learn_history()
        # the ranks agree on saving, preemption and a loss spike (agreement.py): time triggers and signals
        # one step later, without waiting; rollback_if and metric triggers at once; nothing at world size 1
        policy = self.recovery if self.recovery is not None and self.recovery.rollback_if is not None else None
        due = lambda triggers: self.due(epoch_end=False, triggers=triggers)  # noqa: E731
        spike = policy.spiked(clean) if policy is not None else None
        at_once = self.selftest is not None  # its planned SIGTERM saves the very step planned
        flags = self.agreement.at_step(due, self.signals.received is not None, spike, at_once)
        if flags & SPIKE:  # before this step is saved: recover() rolls back to an earlier checkpoint
            raise recovery.LossSpike(progress.step, clean, here=bool(spike))
        info = self.saver.save(state) if flags & SAVE else None
        if flags & SIGNAL:
            sig = self.signals.received or signal.SIGTERM  # a peer's signal: stop at the same step
            self.saver.flush(raise_errors=False)
            preempt_and_exit(ckpt, state, sig, self.signals.received_at or time.monotonic())
        self.agreement.after_step(due, self.signals.received is not None, at_once or policy is not None)
        if self.selftest is not None:
            self.selftest.after_step(ckpt)  # a planned interruption or stop (SystemExit(0) after step N)
        return info

    def end_epoch(self, ckpt: Checkpointer, state: Mapping[str, Any],
                  metrics: Mapping[str, Any]) -> CheckpointInfo | None:
        """:meth:`unbroken.Checkpointer.end_epoch` once the state is adapted and the run open (see there)."""
        core = self.core
        core.metrics.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()})
        self.epoch_loop.close(state)
        if self.guard is not None:  # the next step starts from here, not from the epoch's last step
            self.guard.mark(self.guard.prepare(core.progress.state_dict()))
        # at once (blocking, once per epoch), with what the last step started agreeing on (agreement.py)
        flags = self.agreement.now((SAVE if self.due(epoch_end=True) else 0)
                                   | (SIGNAL if self.signals.received else 0))
        info = self.saver.save(state, kind="regular" if flags & SAVE else "preemption") if flags else None
        if flags & SIGNAL:  # saved above; preempt_and_exit finds this step saved and exits with 75
            self.saver.flush(raise_errors=False)
            preempt_and_exit(ckpt, state, self.signals.received or signal.SIGTERM,
                             self.signals.received_at or time.monotonic())
        return info

    def _learn_history(self) -> None:
        """``save_every="auto"`` and ``RamTier(persist_every="auto")``: once per segment (a process, or a
        rollback inside one), what the run index says of the run's failures so far (on the ranks that keep
        the index; the others keep the prior)."""
        recorder, persists = self.core.recorder, self.core.run.ram.auto if self.core.run.ram is not None else None
        segment = recorder.segment_id if recorder is not None else None
        if recorder is None or segment is None or segment == self._history_of or recorder.index is None:
            return
        self._history_of = segment
        try:
            failures, wall = failure_history(recorder.index, time.time())
            losses = lost_save_history(recorder.index, time.time())[0] if persists is not None else 0
        except Exception as e:  # noqa: BLE001 - the index is an aid: the prior stands in
            log.debug("the auto intervals: the run index could not say the run's failures (%s)", e)
            return
        if persists is not None:
            persists.observe_history(losses, wall, time.monotonic())
        if self.core.schedule.auto and (said := self.core.schedule.observe_history(failures, wall, time.monotonic())):
            recorder.event("save_interval", said, step=self.core.progress.step,
                           data={"seconds": self.core.schedule.chosen_s})

    def due(self, epoch_end: bool, triggers: Sequence[Trigger] | None = None) -> bool:
        """Whether this instant is to be saved: a trigger asks, and it was not saved already."""
        sched, progress, metrics = self.core.schedule, self.core.progress, self.core.metrics
        if not sched.due(progress.step, progress.epoch, epoch_end, metrics, triggers):
            return False
        return not sched.already_saved(progress.step, clean_metrics(metrics), progress.epoch)
