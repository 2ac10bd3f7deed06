"""What a :class:`~unbroken.Checkpointer` does when a signal arrived or a step raised.

Both paths use the Checkpointer's public API only (``save``, ``flush``, ``wait``, ``close``,
``progress``, ``last_saved``, ``preemption``, ``events``, ``comm``), so they are a plug-in
like any other.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..events import Preempted
from . import EXIT_PREEMPTED, signals, slurm
from .guard import StepGuard
from .recovery import LossSpike

if TYPE_CHECKING:
    from ..api import CheckpointInfo
    from .host import Host

log = logging.getLogger("unbroken")


def preempt_and_exit(ckpt: Host, state: Mapping[str, Any], sig: signal.Signals, received_at: float) -> None:
    """Save (unless just saved), wait for the upload if tiered, requeue, exit 75."""
    grace = ckpt.preemption.grace_period
    waited = time.monotonic() - received_at
    t0 = time.monotonic()
    ckpt.flush(raise_errors=False)  # a background save in flight commits first (or is logged)
    last = ckpt.last_saved
    if last is None or last.step != ckpt.progress.step:
        last = ckpt.save(state, kind="preemption")
    took = time.monotonic() - t0
    budget = f" of the {grace:.0f} s grace period" if grace else ""
    log.warning("%s received: finished step %d %.1f s later, saved in %.1f s%s; exiting with %d",
                sig.name, ckpt.progress.step, waited, took, budget, EXIT_PREEMPTED)
    if grace and waited + took > grace:
        log.error("the preemption save ended %.1f s after the signal, past the %.0f s grace period: "
                  "ask the scheduler for a longer warning (e.g. --signal=USR1@%d)",
                  waited + took, grace, int(2 * (waited + took)) + 30)
    exit_preempted(ckpt, sig, received_at, last.name if last else None, took)


def exit_preempted(ckpt: Host, sig: signal.Signals, received_at: float, checkpoint: str | None,
                   took: float = 0.0) -> None:
    """The end of every preemption: wait for the upload (tiered), record, requeue, exit 75."""
    grace = ckpt.preemption.grace_period
    if grace and not ckpt.wait(timeout=max(1.0, grace - (time.monotonic() - received_at) - 5)):
        log.error("the preemption checkpoint is not yet uploaded; it is kept locally")
    print(f"preempted at step {ckpt.progress.step}", flush=True)
    ckpt.events.publish(Preempted(sig.name, ckpt.progress.step, checkpoint, time.monotonic() - received_at,
                                  took, grace, ckpt.preemption.requeue))
    if ckpt.preemption.requeue and ckpt.comm.coordinator:
        slurm.requeue()
    signals.exiting_after_preemption()  # torchrun SIGTERMs the other ranks as soon as one exits: still 75
    ckpt.close()
    signals.closed_for_exit()
    raise SystemExit(EXIT_PREEMPTED)


def step_failed(ckpt: Host, guard: StepGuard, exc: BaseException | None, preempted: tuple[Any, float] | None) -> None:
    """A step raised inside ``ckpt.guard``: write the exact emergency checkpoint; if a preemption
    signal had arrived, the exception is its consequence (a DataLoader worker killed by the same
    SIGTERM to the process group): end as a preemption, exit 75, instead of a crash."""
    info = emergency_save(ckpt, guard, exc)
    if preempted is not None:
        sig, received_at = preempted
        log.warning("the step failed after %s (%s: %s): treated as part of the preemption", sig.name,
                    type(exc).__name__, exc)
        last = info or ckpt.last_saved
        exit_preempted(ckpt, sig, received_at, last.name if last else None)


def emergency_save(ckpt: Host, guard: StepGuard, exc: BaseException | None) -> CheckpointInfo | None:
    """The exact emergency checkpoint after a step raised, or none (logged with the reason) when the
    live state cannot be proven to be one instant (see :mod:`unbroken.faults.guard`)."""
    what = f"{type(exc).__name__}: {exc}" if exc is not None else "an exception"
    ckpt.flush(raise_errors=False)  # a background save in flight commits first (or is logged)
    if isinstance(exc, LossSpike):  # the step's state is what rollback_if rejected: never committed
        log.error("step %d: %s; no emergency checkpoint: that state was rejected by rollback_if and is never "
                  "committed. %s", exc.step, what, _fallback(ckpt))
        return None
    if ckpt.comm.world > 1:  # the other ranks are inside the next step's collectives: no save together
        log.error("step %d raised %s on rank %d of %d; no emergency checkpoint with several ranks (the others "
                  "could not join it): the restart resumes from the last committed checkpoint",
                  ckpt.progress.step + 1, what, ckpt.comm.rank, ckpt.comm.world)
        return None
    verdict = guard.verdict()
    if verdict.instant is None:
        log.error("step %d raised %s; no emergency checkpoint: %s, so no checkpoint would describe one instant. "
                  "%s", ckpt.progress.step + 1, what, verdict.why, _fallback(ckpt))
        return None
    if verdict.instant == "end":
        ckpt.progress.step += 1
        ckpt.progress.micro_step = 0
        info = ckpt.save(guard.end_state(), kind="emergency")
        assert info is not None  # an emergency save is written now, never in the background
        log.error("step %d raised %s after the optimizer stepped; emergency checkpoint of the "
                  "post-step state: %s", ckpt.progress.step, what, info.name)
        return info
    start = guard.start
    assert start is not None
    last = ckpt.last_saved
    if last is not None and last.step == start.progress["step"]:
        log.error("step %d raised %s; no emergency checkpoint needed: %s already holds the state "
                  "at its start", start.progress["step"] + 1, what, last.name)
        return None
    info = ckpt.save(start.rebuild(guard.state), kind="emergency", progress=start.progress, rng=start.rng)
    assert info is not None  # an emergency save is written now, never in the background
    log.error("step %d raised %s; emergency checkpoint of the state at its start: %s "
              "(resuming re-runs the step)", start.progress["step"] + 1, what, info.name)
    return info


def _fallback(ckpt: Host) -> str:
    """What the restart resumes from when no emergency checkpoint is written."""
    last = ckpt.last_saved
    if last is None:
        try:
            last = ckpt.latest()
        except Exception as e:  # noqa: BLE001 - only for the message
            return f"The restart resumes from the last committed checkpoint ({ckpt.location}: {e})."
    if last is None:
        return f"{ckpt.location} has no committed checkpoint yet: the restart starts from scratch."
    return f"The restart resumes from the last committed checkpoint, {last.name} (step {last.step}), exactly."
