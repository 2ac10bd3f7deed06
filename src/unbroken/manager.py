"""``Checkpointer``: the run-level API — restore, step, save, retain — as a thin orchestrator.

It owns the training-side concepts (the loop :class:`Progress`, the global RNGs under
the reserved key ``__unbroken__``, save triggers and retention rules) and delegates the
rest: where bytes go and how they commit to :class:`unbroken.run.Run` (one store opened
by URL, plus an optional remote tier), preemption and emergency checkpoints to
:mod:`unbroken.faults`, the run index and ``submit.slurm`` to plug-ins that listen to
:mod:`unbroken.events`. RNGs are restored last.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Literal, TypeVar

from . import console, filewriter, recovery
from .adapting import adapt
from .agreement import StepAgreement
from .api import CheckpointInfo
from .background import BackgroundSaves
from .dist.comm import Comm
from .dist.ddpalign import align_after_restore
from .environment import EnvCheck, fingerprint
from .epochs import EpochLoop
from .epochs import batches as _batches
from .errors import ConfigurationError, NoCheckpointError
from .events import EventBus, Tagged
from .exithooks import at_exit
from .faults import Preemption, slurm
from .faults.guard import StepGuard
from .faults.handlers import step_failed
from .faults.signals import SignalWatcher
from .format.manifest import Manifest
from .policies import Retention, Trigger
from .probe import ProbeFn
from .ram import RamTier
from .recorder import Recorder
from .restoring import restore_into
from .run import Run
from .saved_state import StateRules
from .saving import Saving
from .scheduling import Schedule
from .selftest import protocol as selftest
from .state.checks import UnbrokenWarning  # noqa: F401 (re-exported)
from .state.stateful import Progress
from .stepping import Stepping
from .tags import check_tag
from .tiers import Remote

log = logging.getLogger("unbroken")
T = TypeVar("T")
_open: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_held: set[Checkpointer] = set()
"""Checkpointers with a RAM tier, held until closed: one dropped without ``close()`` (a local variable of
``main()``) must still persist its newest RAM checkpoint at exit, so it is not collected before."""


@at_exit
def _close_at_exit() -> None:
    """A script that never calls close(): wait for its uploads and release its lock/lease."""
    for each in list(_open):  # (this module's own Checkpointers)
        try:
            each._close(ended=False)  # (a crash, or a script that never closes: RAM kept, see unbroken.ram)
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.error("closing %s at exit failed: %s", each.location, e)


class Checkpointer(Saving, Stepping):
    """Saves and restores the complete training state of one run.

    Args:
        location: the run: a folder (created on the first save), ``file://``, ``s3://bucket/run``
            or any fsspec URL (``gs://``, ``az://``, ``memory://``).
        save_every: save from :meth:`step` every this many optimizer steps.
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
            writer process, and a relaunch after a crash restores from memory (:mod:`unbroken.ram`).
        storage_options: for a URL ``location``: endpoint, credentials, profile (never recorded).
        preemption: signal handling (:class:`~unbroken.Preemption`); ``None`` leaves signals alone.
        env: what to record about the environment and what a resume does about changes
            (:class:`~unbroken.EnvCheck`: config, data fingerprint, warn/strict/ignore).
        probe: a function returning a few numbers from the live state (see
            :func:`unbroken.probe_step`), recorded at every save and recomputed right after a
            restore; the verdict is in :attr:`probe_report` and the log.
        rng: also capture and restore the global python/numpy/torch/CUDA RNGs.
        strict: refuse a checkpoint whose top-level keys differ from the state's.
        async_save: write regular saves in the background (:mod:`unbroken.background`): the
            loop waits only for a copy of the state into reused host buffers; at most one
            save is in flight, its errors are raised in the loop, ``close()`` waits for it.
            ``"lazy"`` also defers the copy of the optimizer's tensors (parameters and their
            state) to the background, until the next ``optimizer.step()``
            (:mod:`unbroken.lazy`). With several ranks, background saves commit over a gloo
            group of their own; sharded (FSDP2) states are saved synchronously (logged once).
        allow_unsaved: top-level state keys left out of checkpoints on purpose (e.g. a plain
            ``DataLoader`` you accept to restart): not saved, not restored, not checked. Every
            other value is checked at :meth:`restore` (before any training step): a plain
            ``DataLoader``, a sampler, an iterator or an object that cannot be saved is an
            :class:`~unbroken.errors.UnsupportedStateError` that says what to use instead.
        incremental: store tensor bytes once per run as content-addressed chunks
            (:mod:`unbroken.chunks`): a tensor unchanged since the previous checkpoint (a frozen
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

    def __init__(self, location: str | os.PathLike[str], *, save_every: int | None = None,
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
        self.schedule = Schedule(save_every, trigger, keep_last, retention)
        self.events = EventBus()
        self.comm = Comm()
        self.run = Run(location, storage_options=storage_options, remote=remote, publish=self.events.publish,
                       comm=self.comm, incremental=incremental, ram=ram)
        self.storage_options = storage_options  # for restore(path=URL)
        self.run.check()
        self.location: str = self.run.url
        self.progress = Progress()
        self._epoch_loop = EpochLoop(self.progress)  # the epoch the loop is in (unbroken.epochs)
        self.events.subscribe(self._epoch_loop)
        self.metrics: dict[str, Any] = {}
        self.preemption = preemption if preemption is not None else Preemption(signals=())
        self.env = env if env is not None else EnvCheck()
        self.probe, self.probe_report = probe, None
        self.rng, self.strict = rng, strict
        self.rules = StateRules(allow_unsaved)
        self.allow_unsaved: frozenset[str] = self.rules.allow_unsaved
        self.last_saved: CheckpointInfo | None = None
        if async_save not in (False, True, "lazy"):
            raise ValueError(f"async_save must be False, True or 'lazy', not {async_save!r}")
        self.async_save = async_save
        # a background save needs its own copy, in shared memory for the writer process (unbroken.filewriter)
        self._snapshotter, self._rank_snapshotter, self._file_writer = filewriter.snapshotters(async_save)
        self._background: BackgroundSaves[tuple[str, list[str]], tuple[str, Manifest, float]] = BackgroundSaves()
        # several ranks: background saves run their collectives over a group of their own
        self._save_comm = Comm() if async_save and self.comm.world > 1 else self.comm
        self._signals = SignalWatcher(self.preemption.signals)
        self._agreement = StepAgreement(self.comm, self.schedule.trigger.triggers if self.schedule.trigger else (),
                                        watches_signals=bool(self.preemption.signals))
        self._guard: StepGuard | None = None
        self._started = False  # restore() ran (a resume or a fresh start), or a save found the run empty
        self._recovery: recovery.Policy | None = None  # inside recover(): its loss-spike predicate
        self._environment: dict[str, Any] | None = None
        self._recorder: Recorder | None = None
        self._plugins: list[Any] = []
        # `unbroken selftest` (UNBROKEN_SELFTEST set): per-step fingerprints and planned interruptions;
        # otherwise None, and the cost is one attribute check per step (see unbroken.selftest)
        self._selftest = selftest.attach(self)

    # ------------------------------------------------------------------ lifecycle
    def _begin(self) -> None:
        """Become this run's writer (idempotent): lock, clean leftovers, watch signals, plug in."""
        if self.run.writing:
            return
        self.run.begin()
        _open.add(self)
        if self.run.ram is not None:
            _held.add(self)
        self.rules.watch_optimizers()  # which optimizers step, for the forgotten-optimizer warning
        self._signals.install()
        if self.comm.coordinator and not self.run.readonly:  # one index, one submit script per run
            self._recorder = Recorder(self.run.store)
            self._plugins = [self._recorder, slurm.SubmitScript(self.run.store.local_dir())]
        for p in self._plugins:
            self.events.subscribe(p)
        self._writer_process()  # started before the first background save, off its stall

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
        try:
            done = self._background.collect()
        except Exception as e:
            if raise_errors:
                raise
            log.error("the background save failed: %s: %s", type(e).__name__, e)
            return None
        if done is None:
            return None
        (kind, tags), (final, manifest, took) = done
        return self._committed(final, manifest, kind, tags, took)

    def close(self) -> None:
        """Wait for a background save and pending uploads, release the run and restore the
        previous signal handlers. A failed background save is raised after all that. With a
        RAM tier, the newest checkpoint is persisted and the RAM folder removed (kept when the
        process stops on a signal: see :mod:`unbroken.ram`)."""
        self._close(ended=True)

    def _close(self, ended: bool) -> None:
        """``ended``: training ended normally (``close()``, a ``with`` block left without an
        exception), not a crash: only then is a RAM tier's folder removed."""
        _open.discard(self)
        _held.discard(self)
        failed: BaseException | None = None
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 - raised below, once the run is released
            failed = e
            log.error("the last background save failed: %s: %s", type(e).__name__, e)
        self._background.shutdown()
        if self._file_writer is not None:
            self._file_writer.close()
        self._signals.uninstall()
        self.rules.stop_watching()
        received = self._signals.received
        keep = (f"stopping on a signal ({received.name})" if received is not None
                else None if ended else "stopping without close() (an exception, or the exit of a script that never "
                                        "calls close())")
        self.run.close(keep_ram=keep)  # a relaunch here reads RAM
        self.comm.close()
        self._save_comm.close()
        for p in self._plugins:
            self.events.unsubscribe(p)
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        self._plugins = []
        if failed is not None:
            raise failed

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
        self._guard = guard

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
        if self._environment is None:
            self._environment = fingerprint(config=self.env.config, data=self.env.data)
        return self._environment

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
        if not self._started:
            self._refuse_starting_over("regular", on_purpose=True)

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
        info = restore_into(self, state, path, tag, if_unrestorable)
        self._started = True
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
        Other exceptions, and the last one, propagate unchanged. See :mod:`unbroken.recovery`."""
        policy = recovery.Policy(recovery.check(on, retries, rollback_if, skip_batches, state), retries, rollback_if,
                                 skip_batches)
        outer, self._recovery = self._recovery, policy  # nested: the inner one's predicate while it runs
        try:
            return recovery.run(self, fn, state, policy, self._mark_guard)
        finally:
            self._recovery = outer

    def _mark_guard(self) -> None:
        if self._guard is not None:
            self._guard.mark()

    def epochs(self, state: Mapping[str, Any], epochs: int | Sequence[Any]) -> Iterator[Any]:
        """``for epoch in ckpt.epochs(state, range(1, n + 1)):`` — the epochs left (an ``int`` n:
        ``range(n)``), from the one a resumed run is in; after each epoch's body it calls
        :meth:`end_epoch`, unless the body did (to pass metrics). See :mod:`unbroken.epochs`."""
        return self._epoch_loop.epochs(lambda: self.end_epoch(state), epochs)

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``for batch, i in ckpt.batches(enumerate(range(0, n, bptt))):`` — one epoch's batches without
        a :class:`~unbroken.data.ResumableLoader`, resumed where the last checkpoint was (the first
        ``progress.batch`` items are read and dropped: keep the source cheap, e.g. a ``range``)."""
        return _batches(self.progress, iterable)

    def saved_part(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The part of ``state`` that is saved and restored: all but the ``allow_unsaved`` keys."""
        return self.rules.saved_part(state)

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
