"""Recovery without relaunch: ``Checkpointer.recover(fn, state, on=..., retries=...)``.

``fn`` is the user's training loop. When it raises an exception that is an instance of one of
``on``, the live ``state`` is rolled back *in place* to the newest valid checkpoint and ``fn`` is
called again, in the same process: no interpreter start, no import, no model build. When the fault
was transient the result is bitwise what the run that never failed computes, because a rollback
is exactly what a relaunch does, minus the process:

1. A background save in flight is collected (``flush``); one that failed is logged and is not a
   rollback target (it never committed).
2. Every gradient of the state's modules and optimizers, nested ones included, is set to ``None``,
   as in a fresh process (a ``Gradients`` object in the state gets the saved gradients back in step
   3), and every ``GradScaler``'s per-optimizer stage is cleared. Without this, a step that failed in
   ``backward()`` would leave partial gradients that the re-run step adds to, and one that failed
   after ``scaler.unscale_()`` would make the re-run raise.
3. ``ckpt.restore(state)``: the normal restore path (verification, quarantine of a bad checkpoint
   and fallback to the previous one, every tier, RNGs last; a collective with several ranks, so
   every rank gets the same checkpoint). The data position comes back with the state: a
   ``ResumableLoader`` invalidates iterators started before the restore, and ``ckpt.batches()``
   skips ``progress.batch`` items, so the iterator the re-called ``fn`` creates serves exactly the
   batches after the restored position.
4. A ``RolledBack`` event (the run index records a ``rolled_back`` row and starts a new segment)
   and one log line; then ``fn()`` again.

Rules and their reasons:

- **Retries are consecutive failures without progress.** The count goes back to zero once the
  run completes the step that failed last (a step past it fails). A long run survives any number
  of isolated transient faults; a deterministic fault (the same step fails every time, or an
  earlier one of the re-run stretch) stops after ``retries`` rollbacks. A total budget would end a
  month-long run after its fourth unrelated OOM, which is what nobody wants.
- **Beyond the retries, or not in ``on``, the exception propagates unchanged** (re-raised, same
  object), so the relaunch path — torchrun restarts, SLURM requeue, the guard's emergency
  checkpoint when ``ckpt.guard`` is *around* ``recover`` — works as without recovery. The guard's
  evidence is re-taken after each rollback.
- **A rollback target exists before ``fn`` runs.** If the run's newest checkpoint is not at the live
  state's step (a fresh run; a state restored from another path or an older tag; a run whose tiers
  cannot be listed now), ``recover`` saves the live state first (a regular save, committed before
  ``fn`` starts). Judged by the step alone: a state restored from elsewhere *at the step of the
  run's newest checkpoint* is not saved, and a rollback goes to that newest checkpoint. Restoring "the
  newest" would otherwise roll a fresh run back to nothing, or a branch back onto another branch.
- **Several ranks.** Every rank must raise (step 3 is a collective). First the failing ranks meet
  in a gloo ``monitored_barrier`` bounded by ``UNBROKEN_RECOVER_AGREE_S`` (60 s), then agree on
  "retry or give up" with one collective, so all take the same decision. A rank that did not raise
  and waits in the model's own collective (DDP's all-reduce) never joins: the barrier fails and the
  original exception is re-raised on the ranks that raised, for the relaunch path (torchrun
  restarts every rank). Make the decision global (all-reduce a non-finite flag) so every rank raises.
- **Loss spikes** (``rollback_if``): evaluated in ``ckpt.step`` with that step's metrics, before
  the step is saved; with several ranks it rides on the step's existing agreement (any rank's
  True counts). ``ckpt.step`` raises :class:`LossSpike`, which ``recover`` handles like an
  exception in ``on``: back to the newest checkpoint (an earlier step, since this one was not
  saved), then the data position moves ``skip_batches`` batches on (``ResumableLoader``: global
  batches, never past the epoch's end; ``ckpt.batches()``: items, and a skip past the end of the
  iterable just ends the epoch), and that position is saved at
  once (``kind="rollback"``, the newest checkpoint), so a relaunch reproduces the same run. The skip
  is in the run index's ``rolled_back`` row and in the checkpoint's progress.

Failure modes that are *not* recovered here (they go to the relaunch path): a fault that broke
the device or the process group (a poisoned CUDA context, an aborted NCCL communicator); an
exception in the middle of DDP's backward (its reducer waits for the rest of the reduction); one
rank raising alone (above); and anything the step changed outside ``state``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ..data import StreamLoader
from ..data.loader import ResumableLoader
from ..errors import ConfigurationError, UnbrokenError
from ..events import RolledBack
from ..state.walk import instances

if TYPE_CHECKING:
    from .host import Host

log = logging.getLogger("unbroken")


class LossSpike(UnbrokenError):
    """``rollback_if`` returned True at ``step`` (raised by ``Checkpointer.step`` inside
    :meth:`~unbroken.Checkpointer.recover`; it propagates once the retries are used up)."""

    def __init__(self, step: int, metrics: Mapping[str, Any], here: bool = True) -> None:
        shown = ", ".join(f"{k}={_number(v)}" for k, v in metrics.items())
        where = f"({shown})" if here else f"on another rank (here: {shown})"
        super().__init__(f"rollback_if was true at step {step} {where}")
        self.step = step


def _number(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return v


@dataclass
class Policy:
    """One ``recover()`` call: what is recoverable, and the count of consecutive rollbacks."""

    on: tuple[type[BaseException], ...]
    retries: int
    rollback_if: Callable[[dict[str, Any]], Any] | None = None
    skip_batches: int = 0
    count: int = 0
    failed_at: int | None = None  # the furthest step that failed since the count last reset

    def spiked(self, metrics: dict[str, Any]) -> bool:
        """The user's predicate on one step's metrics (``Checkpointer.step`` asks, before saving)."""
        return self.rollback_if is not None and bool(self.rollback_if(metrics))

    def failure(self, step: int) -> int:
        """Count a failure at ``step``; the attempt number (1 = first rollback since progress)."""
        if self.failed_at is None or step > self.failed_at:
            self.count, self.failed_at = 1, step
        else:
            self.count += 1
        return self.count


def check(on: Any, retries: Any, rollback_if: Any, skip_batches: Any, state: Mapping[str, Any]) -> tuple:
    """The arguments of ``recover``, checked before anything runs; ``on`` as a tuple."""
    classes = (on,) if isinstance(on, type) else tuple(on) if isinstance(on, Iterable) else None
    if not classes or not all(isinstance(c, type) and issubclass(c, Exception) for c in classes):
        raise ConfigurationError(f"on={on!r}: pass an exception class or a tuple of them (subclasses of "
                                 "Exception, e.g. (torch.OutOfMemoryError, FloatingPointError))")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigurationError(f"retries must be a non-negative int, not {retries!r}")
    if rollback_if is not None and not callable(rollback_if):
        raise ConfigurationError(f"rollback_if must be a function of the step's metrics, not {rollback_if!r}")
    if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0:
        raise ConfigurationError(f"skip_batches must be a non-negative int, not {skip_batches!r}")
    if skip_batches and rollback_if is None:
        raise ConfigurationError("skip_batches applies to a loss-spike rollback: pass rollback_if as well")
    if skip_batches:
        loaders = [k for k, v in state.items() if isinstance(v, ResumableLoader)]
        other = [k for k, v in state.items() if isinstance(v, StreamLoader)]
        if len(loaders) > 1 or other:
            raise ConfigurationError(f"skip_batches moves one ResumableLoader (or ckpt.batches()); the state holds "
                                     f"{loaders + other}: skip in your own loop instead")
    return classes


def ensure_target(ckpt: Host, state: Mapping[str, Any]) -> None:
    """Save the live state unless it is the run's newest checkpoint (see the module docstring)."""
    ckpt.flush()  # a failed background save is raised here: the user sees it before training
    try:
        newest = ckpt.latest()
    except Exception as e:  # noqa: BLE001 - a tier that cannot be listed now: save, to be sure of a target
        log.warning("recover: could not list %s (%s: %s); saving the live state as the rollback target",
                    ckpt.location, type(e).__name__, e)
        newest = None
    need = newest is None or newest.step != ckpt.progress.step or ckpt.progress.micro_step != 0
    if ckpt.comm.max(1 if need else 0):  # every rank saves, or none
        ckpt.save(state)
        ckpt.flush()
        log.info("recover: saved step %d first, as the rollback target", ckpt.progress.step)


def run(ckpt: Host, fn: Callable[[], Any], state: MutableMapping[str, Any], policy: Policy,
        after_rollback: Callable[[], None]) -> Any:
    """Call ``fn`` until it returns, rolling back on the exceptions of ``policy`` (module docstring)."""
    ensure_target(ckpt, state)
    while True:
        try:
            return fn()
        except Exception as e:
            spike = isinstance(e, LossSpike) and policy.rollback_if is not None
            if not spike and not isinstance(e, policy.on):
                raise
            failed = e.step if isinstance(e, LossSpike) else ckpt.progress.step + 1
            attempt = policy.failure(failed)
            why = agree(ckpt.comm)
            if why is not None:  # a rank that did not raise cannot join the rollback
                log.error("step %d raised %s on rank %d, but not every rank joined the rollback (%s); re-raising "
                          "it for the relaunch path", failed, type(e).__name__, ckpt.comm.rank, why)
                raise
            if ckpt.comm.max(1 if attempt > policy.retries else 0):
                log.error("step %d raised %s: %s, after %d rollback(s) without getting past it; giving up "
                          "(the relaunch path takes over)", failed, type(e).__name__, e, attempt - 1)
                raise
            error = f"{type(e).__name__}: {e}"
        # outside the except block: the exception's frames (and the dead iterators they hold) are released
        try:
            rollback(ckpt, state, policy, failed, error, attempt, spike)
        except BaseException:  # the restore itself failed (no valid checkpoint, a rank gone): say what came first
            log.error("step %d: %s; rolling back failed:", failed, error)
            raise
        after_rollback()


def agree(comm: Any) -> str | None:
    """Whether every rank is here (in ``recover``, after an exception), within :func:`agree_timeout_s`:
    ``None`` if so, else why not. A gloo ``monitored_barrier`` on the run's private group, so the
    wait is bounded by its own timeout, not by the group's (10 minutes)."""
    if comm.world == 1:
        return None
    try:
        torch.distributed.monitored_barrier(group=comm.group, timeout=timedelta(seconds=agree_timeout_s()),
                                            wait_all_ranks=True)
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def agree_timeout_s() -> float:
    """How long a failing rank waits for the others to join the rollback (``UNBROKEN_RECOVER_AGREE_S``)."""
    return float(os.environ.get("UNBROKEN_RECOVER_AGREE_S", "60"))


def rollback(ckpt: Host, state: MutableMapping[str, Any], policy: Policy, failed: int, error: str, attempt: int,
             spike: bool) -> None:
    """Steps 1-4 of the module docstring."""
    ckpt.flush(raise_errors=False)  # a save in flight commits, or is logged and not used
    drop_gradients(state)
    info = ckpt.restore(state)
    if info is None:  # ensure_target saved one; only a run emptied from outside gets here
        raise ConfigurationError(f"recover: {ckpt.location} has no checkpoint to roll back to")
    skipped = skip(ckpt, state, policy.skip_batches) if spike else 0
    event = RolledBack(failed, info.step, info.name, error, attempt, policy.retries, skipped,
                       info.tiers[0] if info.tiers else "")
    ckpt.events.publish(event)
    log.warning("step %d: %s; rolled back to %s (step %d)%s, retry %d of %d", failed, error, info.name, info.step,
                f", {skipped} batch(es) skipped" if skipped else "", attempt, policy.retries)
    if spike:  # the skip is part of the data position: saved now, so a relaunch takes the same path
        ckpt.save(state, kind="rollback")
        ckpt.flush()


def drop_gradients(state: Mapping[str, Any]) -> None:
    """``grad = None`` for every parameter of the state's modules and optimizers, wherever they are in
    the state (nested in mappings, lists, tuples: :func:`unbroken.state.walk.instances`), as in a fresh
    process; and every AMP ``GradScaler``'s per-optimizer stage (unscaled, stepped) cleared, as its own
    ``update()`` does (a failure between ``unscale_()`` and ``update()`` would otherwise make the re-run
    step raise "unscale_() has already been called")."""
    obj: torch.nn.Module | torch.optim.Optimizer
    for obj in instances(state, (torch.nn.Module, torch.optim.Optimizer)):
        if isinstance(obj, torch.nn.Module):
            params: Iterable[torch.Tensor] = obj.parameters()
        else:
            params = (p for g in obj.param_groups for p in g["params"])
        for p in params:
            p.grad = None
    for scaler in instances(state, torch.amp.GradScaler):
        stages = getattr(scaler, "_per_optimizer_states", None)
        if stages is not None:
            stages.clear()  # a defaultdict: every optimizer back to READY


def skip(ckpt: Host, state: MutableMapping[str, Any], n: int) -> int:
    """Move the data position ``n`` batches on; the number skipped (see the module docstring)."""
    if n == 0:
        return 0
    loaders = [v for v in state.values() if isinstance(v, ResumableLoader)]
    if not loaders:  # ckpt.batches(): the counted loop drops progress.batch items
        ckpt.progress.batch += n
        return n
    loader = loaders[0]
    sd = loader.state_dict()
    done = 0
    while done < n and loader.position < loader.epoch_length:  # never past the epoch's end
        new = min(loader.position + loader.global_batch, loader.epoch_length)
        sd = {**sd, "position": new, "samples_seen": sd["samples_seen"] + new - loader.position}
        loader.load_state_dict(sd)  # also invalidates iterators started before the skip
        done += 1
    ckpt.progress.epoch, ckpt.progress.samples = loader.epoch, loader.samples_seen
    return done
