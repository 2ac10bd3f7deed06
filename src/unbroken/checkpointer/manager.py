"""``Checkpointer``: the run-level API — restore, step, save, retain — as a thin orchestrator.

It owns the training-side concepts (the loop :class:`Progress`, the global RNGs under
the reserved key ``__unbroken__``, save triggers and retention rules) and delegates the
rest: where bytes go and how they commit to :class:`unbroken.run.run.Run` (one store opened
by URL, plus an optional remote tier), preemption and emergency checkpoints to
:mod:`unbroken.faults`, the run index and ``submit.slurm`` to plug-ins that listen to
:mod:`unbroken.events`. RNGs are restored last.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Literal, TypeVar

from .._support import console
from ..api import CheckpointInfo
from ..checkpoint.adapting import adapt
from ..checkpoint.tags import check_tag
from ..dist.comm import Comm
from ..dist.ddpalign import align_after_restore
from ..errors import ConfigurationError, NoCheckpointError
from ..events import EventBus, Tagged
from ..faults import Preemption, recovery
from ..faults.guard import StepGuard
from ..faults.handlers import step_failed
from ..faults.signals import SignalWatcher
from ..policies import Retention, Trigger
from ..run.run import Run
from ..run.scheduling import Schedule
from ..selftest import protocol as selftest
from ..state.checks import UnbrokenWarning  # noqa: F401 (re-exported)
from ..state.stateful import Progress
from ..tiers.ram import RamTier
from ..tiers.remote import Remote
from .core import Core
from .environment import EnvCheck
from .epochs import EpochLoop
from .epochs import batches as _batches
from .lifecycle import Session
from .probe import ProbeFn, ProbeReport
from .restoring import restore_into
from .saved_state import StateRules
from .saving import Saver
from .stepping import Stepper

log = logging.getLogger("unbroken")
T = TypeVar("T")


class Checkpointer:
    """Saves and restores the complete training state of one run.

    Args:
        location: the run: a folder (created on the first save), ``file://``, ``s3://bucket/run``
            or any fsspec URL (``gs://``, ``az://``, ``memory://``).
        save_every: save from :meth:`step` every this many optimizer steps; ``"auto"``: at the interval
            that loses the least time, from what this run's saves block and how often it failed
            (:class:`unbroken.policies.AutoInterval`; ``trigger=AutoInterval(mtbf_hours=...)`` sets its
            prior).
        keep_last: how many committed checkpoints to keep (``None``: all). Older ones are
            deleted only after a newer one has committed.
        trigger: more save triggers (:mod:`unbroken.policies`: ``EveryMinutes(30) |
            OnImprovement("val_loss")``), combined with ``save_every``.
        retention: more checkpoints to keep (``KeepBest(2, "val_loss") | KeepEveryNSteps(10_000)``),
            combined with ``keep_last``. Tagged checkpoints are always kept.
        remote: a :class:`~unbroken.Remote` tier: checkpoints are saved to ``location`` (a fast
            local folder) and uploaded there in the background, with their own retention.
        ram: a :class:`~unbroken.RamTier`: regular saves commit to node-local shared memory
            (``/dev/shm``), every ``persist_every``-th is copied to ``location`` by a separate
            writer process, and a relaunch after a crash restores from memory (:mod:`unbroken.tiers.ram`).
        storage_options: for a URL ``location``: endpoint, credentials, profile (never recorded).
        preemption: signal handling (:class:`~unbroken.Preemption`); ``None`` leaves signals alone.
        env: what to record about the environment and what a resume does about changes
            (:class:`~unbroken.EnvCheck`: config, data fingerprint, warn/strict/ignore).
        probe: a function returning a few numbers from the live state (see
            :func:`unbroken.probe_step`), recorded at every save and recomputed right after a
            restore; the verdict is in :attr:`probe_report` and the log.
        rng: also capture and restore the global python/numpy/torch/CUDA RNGs.
        strict: refuse a checkpoint whose top-level keys differ from the state's.
        async_save: write regular saves in the background (:mod:`unbroken.checkpoint.background.thread`): the
            loop waits only for a copy of the state into reused host buffers; at most one
            save is in flight, its errors are raised in the loop, ``close()`` waits for it.
            ``"lazy"`` also defers the copy of the optimizer's tensors (parameters and their
            state) to the background, until the next ``optimizer.step()``
            (:mod:`unbroken.checkpoint.background.lazy`). With several ranks, background saves commit over a gloo
            group of their own; sharded (FSDP2) states are saved synchronously (logged once).
        allow_unsaved: top-level state keys left out of checkpoints on purpose (e.g. a plain
            ``DataLoader`` you accept to restart): not saved, not restored, not checked. Every
            other value is checked at :meth:`restore` (before any training step): a plain
            ``DataLoader``, a sampler, an iterator or an object that cannot be saved is an
            :class:`~unbroken.errors.UnsupportedStateError` that says what to use instead.
        incremental: store tensor bytes once per run as content-addressed chunks
            (:mod:`unbroken.checkpoint.chunks`): a tensor unchanged since the previous checkpoint (a frozen
            base model under LoRA or adapters) is referenced, not written again. Retention then
            also deletes the chunks no checkpoint uses. Off by default: with every tensor
            changing (full fine-tuning) it writes as much and hashes more.

    A bad location (unknown scheme, missing extra, no bucket, refused credentials) raises
    :class:`~unbroken.errors.StorageError` here, before any training. The first
    :meth:`restore`, :meth:`save` or :meth:`step` takes the run's writer lock (a second
    process is refused with :class:`RunLockedError`), removes leftovers of interrupted saves
    and installs the signal handlers; :meth:`close` (or leaving a ``with`` block) undoes
    that, after waiting for pending uploads.
    """

    def __init__(self, location: str | os.PathLike[str], *, save_every: int | Literal["auto"] | None = None,
                 keep_last: int | None = 3, trigger: Trigger | None = None, retention: Retention | None = None,
                 remote: Remote | None = None, storage_options: Mapping[str, Any] | None = None,
                 preemption: Preemption | None = Preemption(), env: EnvCheck | None = None,
                 probe: ProbeFn | None = None, rng: bool = True, strict: bool = True,
                 async_save: bool | Literal["lazy"] = False, allow_unsaved: Iterable[str] = (),
                 incremental: bool = False, ram: RamTier | None = None) -> None:
        console.install()
        if preemption is not None and not isinstance(preemption, Preemption):  # checked before anything is created
            raise ConfigurationError(f"preemption={preemption!r}: pass unbroken.Preemption(...), or None to leave "
                                     "signals alone")
        location = selftest.run_location(location)  # `unbroken selftest` owns the run folders
        if async_save not in (False, True, "lazy"):
            raise ValueError(f"async_save must be False, True or 'lazy', not {async_save!r}")
        events, comm = EventBus(), Comm()
        run = Run(location, storage_options=storage_options, remote=remote, publish=events.publish, comm=comm,
                  incremental=incremental, ram=ram)
        run.check()
        # what the parts share (unbroken.checkpointer.core); the attributes below are the same objects, for users
        self._core = core = Core(
            run=run, comm=comm, progress=Progress(), schedule=Schedule(save_every, trigger, keep_last, retention),
            events=events, rules=StateRules(allow_unsaved),
            preemption=preemption if preemption is not None else Preemption(signals=()),
            env=env if env is not None else EnvCheck(), storage_options=storage_options, probe=probe, rng=rng,
            strict=strict, async_save=async_save)
        self.run, self.comm, self.events, self.schedule, self.progress = run, comm, events, core.schedule, core.progress
        self.location: str = run.url
        self.storage_options, self.preemption, self.env = storage_options, core.preemption, core.env
        self.probe, self.rng, self.strict, self.async_save = probe, rng, strict, async_save
        self.rules = core.rules
        self.allow_unsaved: frozenset[str] = core.rules.allow_unsaved
        self._epoch_loop = EpochLoop(core.progress)  # the epoch the loop is in (unbroken.checkpointer.epochs)
        events.subscribe(self._epoch_loop)
        if run.ram is not None and run.ram.auto is not None:
            events.subscribe(run.ram)  # RamTier(persist_every="auto") times the steps
        self._signals = SignalWatcher(core.preemption.signals)
        self._saver = Saver(core)  # the save path (unbroken.checkpointer.saving)
        self._stepper = Stepper(core, self._saver, self._signals, self._epoch_loop)  # the step boundary
        self._session = Session(core, self._saver, self._signals)  # as the run's writer (lifecycle.py)
        # `unbroken selftest` (UNBROKEN_SELFTEST set): per-step fingerprints and planned interruptions;
        # otherwise None, and the cost is one attribute check per step (see unbroken.selftest)
        self._selftest = self._stepper.selftest = selftest.attach(self)

    @property
    def metrics(self) -> dict[str, Any]:
        """The metrics given since the last save (a restore sets those of the checkpoint)."""
        return self._core.metrics

    @property
    def last_saved(self) -> CheckpointInfo | None:
        """What the last save of this process committed (``None`` before the first)."""
        return self._core.last_saved

    @property
    def probe_report(self) -> ProbeReport | None:
        """The ``probe``'s verdict after the last restore (``None``: no probe, or nothing restored)."""
        return self._core.probe_report

    # ------------------------------------------------------------------ lifecycle
    def _begin(self) -> None:
        """Become this run's writer (idempotent): lock, clean leftovers, watch signals, plug in."""
        self._session.begin()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background work: a background save (its error is raised), then uploads to
        the remote tier (``timeout`` applies to these); False if uploads are still pending, or
        one could not be made and no newer checkpoint reached the remote since."""
        self.flush()
        return self.run.wait(timeout)

    def flush(self, raise_errors: bool = True) -> CheckpointInfo | None:
        """Wait for the background save in flight (``async_save``) to commit; return what it
        committed, or ``None`` if none was in flight. Its error is raised (or, with
        ``raise_errors=False``, logged: the emergency and preemption paths do that)."""
        return self._saver.flush(raise_errors)

    def close(self) -> None:
        """Wait for a background save and pending uploads, release the run and restore the
        previous signal handlers. A failed background save is raised after all that. With a
        RAM tier, the newest checkpoint is persisted and the RAM folder removed (kept when the
        process stops on a signal: see :mod:`unbroken.tiers.ram`)."""
        self._close(ended=True)

    def _close(self, ended: bool) -> None:
        self._session.end(ended)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(ended=exc[0] is None)

    def guard(self, state: Mapping[str, Any]) -> StepGuard:
        """``with ckpt.guard(state):`` around the training loop: if a step raises, write an
        exact emergency checkpoint first (see :mod:`unbroken.faults.guard`), then re-raise."""
        state = adapt(state)
        self._begin()
        def on_error(guard: StepGuard, exc: BaseException | None) -> None:
            got = self._signals.received
            step_failed(self, guard, exc, (got, self._signals.received_at or time.monotonic()) if got else None)

        return StepGuard(state, self.progress, attach=self._attach_guard, on_error=on_error,
                         unsaved=self.allow_unsaved)

    def _attach_guard(self, guard: StepGuard | None) -> None:
        self._stepper.guard = guard

    # ------------------------------------------------------------------ discovery
    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints with a readable manifest (every tier), newest first; not verified."""
        return self.run.checkpoints()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint (not verified), or ``None``."""
        found = self.checkpoints()
        return found[0] if found else None

    def environment(self) -> dict[str, Any]:
        """This process's environment fingerprint (computed once, at first use)."""
        return self._core.environment()

    # -------------------------------------------------------------------- restore
    def start_fresh(self) -> None:
        """Start over on purpose instead of resuming: what a script that deliberately does not resume
        (the HF Trainer's ``resume_from_checkpoint=False``, the ``else`` of an ``if args.resume:``)
        calls instead of :meth:`restore`. On a run that has checkpoints, the start-over is logged and
        recorded in the run index (a ``started_over`` event), and retention replaces the old
        checkpoints as new ones commit. Without it (or ``UNBROKEN_START_FRESH=1``), the first save of a
        process that never called :meth:`restore` on a run with checkpoints is refused, before
        anything is written or deleted. Collective, as :meth:`restore`."""
        self._begin()
        if not self._core.started:
            self._saver.refuse_starting_over("regular", on_purpose=True)

    def restore(self, state: MutableMapping[str, Any], path: str | os.PathLike[str] | None = None, *,
                tag: str | None = None,
                if_unrestorable: Literal["raise", "start_fresh"] = "raise") -> CheckpointInfo | None:
        """Load the newest valid checkpoint into ``state`` in place; return what was loaded.

        Checkpoints that fail verification are moved to ``quarantine/`` with the reason
        logged, and the previous one is tried; in a tiered run, a checkpoint only the remote
        has is downloaded (verified) first. With ``incremental=True``, a damaged or missing
        chunk whose exact bytes the live ``state`` still holds (same SHA-256: a frozen layer
        loaded again) is rewritten from them and the checkpoint restores. A checkpoint written
        by a newer unbroken raises :class:`NewerFormatError` (falling back past it would
        silently lose progress). Returns ``None`` (a fresh start) for a run that has no
        checkpoint. A run that has checkpoints none of which can be restored (all damaged, or
        quarantined earlier, or a remote tier that cannot be listed) raises
        :class:`NoValidCheckpointError` naming each one and its damage, never a silent restart
        from step 0; ``if_unrestorable="start_fresh"`` (or the environment variable
        ``UNBROKEN_START_FRESH=1``) starts from scratch on purpose, the damaged checkpoints left
        in ``quarantine/``. With ``path``, load exactly that checkpoint (a folder or URL) and
        raise :class:`CorruptCheckpointError` if it is invalid; with ``tag``, the checkpoint of
        this run carrying that tag. Nothing of ``state`` changes unless the restore succeeds.
        """
        state = adapt(state)
        if if_unrestorable not in ("raise", "start_fresh"):
            raise ConfigurationError(f"if_unrestorable must be 'raise' or 'start_fresh', not {if_unrestorable!r}")
        self.rules.check_reserved(state)
        self.rules.validate(state)
        self._begin()
        if self._selftest is not None:
            self._selftest.watch(state)  # fingerprints the state once restored (on Restored / Started)
        self.flush()  # a save in flight commits (and stops reading the live state) first
        info = restore_into(self._core, state, path, tag, if_unrestorable)
        self._core.started = True
        if info is not None and self.comm.world > 2:
            align_after_restore(state)  # DDP's first step summed as without the restart (unbroken.dist.ddpalign)
        return info

    # ----------------------------------------------------------------------- save
    def recover(self, fn: Callable[[], T], state: MutableMapping[str, Any], *, on: Any, retries: int = 3,
                rollback_if: Callable[[dict[str, Any]], Any] | None = None, skip_batches: int = 0) -> T:
        """Call ``fn()`` (the training loop) and return its result; when it raises an instance of
        ``on``, roll ``state`` back in place to the newest checkpoint and call it again, up to
        ``retries`` consecutive times without getting past the failed step. ``rollback_if(metrics)``
        true at a ``step()`` rolls back to before that step and skips ``skip_batches`` batches.
        Other exceptions, and the last one, propagate unchanged. See :mod:`unbroken.faults.recovery`."""
        policy = recovery.Policy(recovery.check(on, retries, rollback_if, skip_batches, state), retries, rollback_if,
                                 skip_batches)
        stepper = self._stepper
        outer, stepper.recovery = stepper.recovery, policy  # nested: the inner one's predicate while it runs
        try:
            return recovery.run(self, fn, state, policy, self._mark_guard)
        finally:
            stepper.recovery = outer

    def _mark_guard(self) -> None:
        if self._stepper.guard is not None:
            self._stepper.guard.mark()

    def epochs(self, state: Mapping[str, Any], epochs: int | Sequence[Any]) -> Iterator[Any]:
        """``for epoch in ckpt.epochs(state, range(1, n + 1)):`` — the epochs left (an ``int`` n:
        ``range(n)``), from the one a resumed run is in; after each epoch's body it calls
        :meth:`end_epoch`, unless the body did (to pass metrics). See :mod:`unbroken.checkpointer.epochs`."""
        return self._epoch_loop.epochs(lambda: self.end_epoch(state), epochs)

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``for batch, i in ckpt.batches(enumerate(range(0, n, bptt))):`` — one epoch's batches without
        a :class:`~unbroken.data.ResumableLoader`, resumed where the last checkpoint was (the first
        ``progress.batch`` items are read and dropped: keep the source cheap, e.g. a ``range``)."""
        return _batches(self.progress, iterable)

    def saved_part(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The part of ``state`` that is saved and restored: all but the ``allow_unsaved`` keys."""
        return self.rules.saved_part(state)

    # --------------------------------------------------------------- step, save
    def step(self, state: Mapping[str, Any], **metrics: Any) -> CheckpointInfo | None:
        """Mark one optimizer step done; save if it is due. Metrics go into the manifest.

        If a watched signal arrived, save now (if not just saved) and exit with
        :data:`~unbroken.faults.EXIT_PREEMPTED` (``SystemExit``, so ``finally`` blocks run).
        With several ranks, a signal and a time trigger take effect one step later, on every
        rank at the same step: they are agreed in the background of the next step, without a
        blocking collective (:mod:`unbroken.checkpointer.agreement`). See :mod:`unbroken.checkpointer.stepping`.
        """
        state = adapt(state)
        self._begin()
        return self._stepper.step(self, state, metrics)

    def end_epoch(self, state: Mapping[str, Any], **metrics: Any) -> CheckpointInfo | None:
        """The epoch ends: call it last in the epoch, after its evaluation and ``scheduler.step()``
        (:meth:`epochs` does), passing the evaluation's metrics. ``progress.epoch`` moves on if the
        batch loop did not move it (it broke off, or there is none), every ``ResumableLoader`` in
        the state starts the new epoch, and this instant is saved if a trigger asks
        (``AtEpochEnd()``, ``OnImprovement("val_loss")``) or a preemption signal arrived during
        the epoch-end work (then the process exits with 75). Does not advance the step."""
        state = adapt(state)
        self._begin()
        return self._stepper.end_epoch(self, state, metrics)

    def save(self, state: Mapping[str, Any], metrics: dict[str, Any] | None = None, *, kind: str = "regular",
             tag: str | None = None, progress: Mapping[str, int] | None = None,
             rng: Mapping[str, Any] | None = None) -> CheckpointInfo | None:
        """Save ``state`` (plus progress and RNG) now, then apply retention; what was committed.

        With ``async_save``, a regular save returns ``None`` once the state is copied, and is
        written in the background (:meth:`flush` waits for it and returns its info). A save
        first waits for the one in flight. A ``tag`` names the checkpoint and protects it from
        retention. ``progress`` and ``rng`` replace the live counters and RNG states with
        those of another instant (emergency checkpoints of the state at a step's start).
        See :mod:`unbroken.checkpointer.saving`.
        """
        state = adapt(state)
        self._core.rules.check_reserved(state)
        self._begin()
        return self._saver.save(state, metrics, kind=kind, tag=tag, progress=progress, rng=rng)

    # ------------------------------------------------------------ retention, tags
    def prune(self, keep: str | None = None) -> list[str]:
        """Apply retention: delete committed checkpoints no rule keeps (never the newest)."""
        return self.run.prune(self.schedule, keep)

    def tag(self, tag: str, checkpoint: str | None = None) -> str:
        """Tag a committed checkpoint (default: the newest); tagged ones are never pruned."""
        check_tag(tag)
        self._begin()
        names = [c.name for c in self.checkpoints()]
        name = checkpoint if checkpoint is not None else (names[0] if names else None)
        if name not in names:
            raise NoCheckpointError(f"no committed checkpoint {name!r} in {self.location}")
        if self.comm.coordinator:
            tags = self.run.tags()
            tags[tag] = name
            self.run.set_tags(tags)
        self.comm.barrier()
        self.events.publish(Tagged(tag, name))
        return name
