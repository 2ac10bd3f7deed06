"""The save path of the :class:`~unbroken.Checkpointer`: capture, write (now or in the background),
and the bookkeeping after a commit (events, the log line, retention), in the training thread.

:class:`Saving` is a part of the Checkpointer kept in its own module (the class inherits it): its
methods use the Checkpointer's own state (the snapshotters, the background saves, the run, the
recorder), which :mod:`unbroken.manager` sets up.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from .adapting import adapt
from .api import CheckpointInfo
from .dist.comm import Comm
from .errors import ConfigurationError
from .events import Saved, StartedOver
from .format.manifest import Manifest
from .lazy import StepGate, step_only_storages
from .probe import run_probe
from .restoring import sync_data_position
from .saved_state import split
from .state.checks import clean_metrics
from .tags import check_tag

log = logging.getLogger("unbroken")


class Saving:
    """The save path of :class:`~unbroken.Checkpointer` (see the module docstring)."""

    last_saved: CheckpointInfo | None

    def _refuse_starting_over(self, kind: str, on_purpose: bool = False) -> None:
        """The first save of a process that never called ``restore()``: refused, before anything is
        written or deleted, if the run already has checkpoints (a forgotten ``restore()``, an ``if
        args.resume:`` without the flag): it would start again at step 0 under newer sequence numbers,
        and retention would delete the run's real checkpoints. ``start_fresh()`` (``on_purpose``) or
        ``UNBROKEN_START_FRESH=1`` starts over on purpose (logged, and recorded in the run index as a
        ``started_over`` event). The coordinator
        lists the run (every tier) and tells the other ranks, so every rank decides alike (the first
        save is collective: nothing else is in flight on the group)."""
        if kind == "imported":  # ``unbroken import`` writes the run's first checkpoint itself
            self._started = True
            return
        found: list[Any] | str | None = None
        if self.comm.coordinator:
            try:
                listed = self.run.checkpoints()
                found = [len(listed), max(c.step for c in listed)] if listed else None
            except Exception as e:  # noqa: BLE001 - said on every rank below, never a hang of the others
                found = f"{type(e).__name__}: {e}"
        found = self.comm.broadcast(found)
        if isinstance(found, str):
            raise ConfigurationError(f"cannot tell whether {self.location} already has checkpoints before this "
                                     f"process's first save (it never called restore()): {found}")
        if found is None:
            self._started = True
            return
        count, newest = found
        why = "start_fresh()" if on_purpose else "UNBROKEN_START_FRESH=1"
        if not on_purpose and os.environ.get("UNBROKEN_START_FRESH") != "1":
            raise ConfigurationError(
                f"{self.location} already has {count} checkpoint(s), the newest at step {newest}, and this "
                f"process is saving without having called restore(): it would start over (it is at step "
                f"{self.progress.step}) and retention would delete those checkpoints. Call ckpt.restore(state) "
                f"before training (it resumes from step {newest}); to start over on purpose, call "
                "ckpt.start_fresh() instead, use a new run location, or set UNBROKEN_START_FRESH=1.")
        log.warning("%s: %s starts over without restoring (at step %d); its %d checkpoint(s) (newest at step %d) "
                    "go as retention replaces them", why, self.location, self.progress.step, count, newest)
        self.events.publish(StartedOver(self.progress.step, count, newest, why))
        self._started = True

    def save(self, state: Mapping[str, Any], metrics: dict[str, Any] | None = None, *, kind: str = "regular",
             tag: str | None = None, progress: Mapping[str, int] | None = None,
             rng: Mapping[str, Any] | None = None) -> CheckpointInfo | None:
        """Save ``state`` (plus progress and RNG) now, then apply retention; what was committed.

        With ``async_save``, a regular save returns ``None`` once the state is copied, and is
        written in the background (:meth:`flush` waits for it and returns its info). A save
        first waits for the one in flight. A ``tag`` names the checkpoint and protects it from
        retention. ``progress`` and ``rng`` replace the live counters and RNG states with
        those of another instant (emergency checkpoints of the state at a step's start).
        """
        state = adapt(state)
        self.rules.check_reserved(state)
        self._begin()
        if not self._started:
            self._refuse_starting_over(kind)
        self.flush(raise_errors=kind == "regular")  # backpressure: at most one save in flight
        if metrics:
            self.metrics.update(metrics)
        self.rules.validate(state)
        self.rules.before_save(state, self.progress.micro_step, self.progress.step)
        tags = [check_tag(tag)] if tag else []
        if progress is None:
            sync_data_position(self.progress, state)
        prog = dict(progress) if progress is not None else self.progress.state_dict()
        state = self.saved_part(state)
        shared, mine = split(state, prog, self.schedule.state_dict() if self.schedule.trigger is not None else None,
                             self.rng, rng)
        if self._recorder is not None:  # the metric rows up to this checkpoint are durable before it commits
            self._recorder.durable(prog["step"], sync=not self.run.saves_to_ram(kind))
        t0 = time.monotonic()
        probe = run_probe(self.probe) if self.probe is not None and kind != "emergency" else None
        lazy = self.async_save == "lazy" and kind == "regular"
        snap, rank_snap = (self._snapshotter.capture(shared, defer=step_only_storages(state) if lazy else frozenset()),
                           self._rank_snapshotter.capture(mine, prefix=f"r{self.comm.rank:05d}-"))
        fields = dict(step=prog["step"], metrics=clean_metrics(self.metrics), progress=prog,
                      environment=self.environment(), kind=kind, probe=probe or {}, tags=tags)

        def write(broken: BaseException | None = None, comm: Comm = self._save_comm) -> tuple[str, Manifest, float]:
            final, manifest = self.run.write(snap, rank_snap, f"step-{prog['step']:09d}", comm, broken, **fields)
            return final, manifest, time.monotonic() - t0

        if self._in_background(kind, snap):
            if self._writer_process(kind):
                snap.writer = rank_snap.writer = self._file_writer
            self.schedule.saved(prog["step"], fields["metrics"], prog.get("epoch", 0))
            gate = StepGate([snap]) if snap.deferred or snap.lazy_events else None
            self._background.submit(write, (kind, tags), gate)
            log.debug("step %d copied in %.3f s; writing in the background", prog["step"], time.monotonic() - t0)
            return None
        final, manifest, took = write(comm=self.comm)
        return self._committed(final, manifest, kind, tags, took)


    def _writer_process(self, kind: str = "regular") -> bool:
        """Whether a background save of ``kind`` is written by the writer process (a full checkpoint
        into a local folder, see :mod:`unbroken.filewriter`); if so, it is started (from the training
        thread: it lives as long as the thread that started it) if it is not running."""
        if self._file_writer is None or self.run.readonly or self.run.chunks is not None \
                or not self.run.on_local_disk(kind):
            return False
        self._file_writer.start()
        return True

    def _in_background(self, kind: str, snap: Any) -> bool:
        """Whether a save of ``kind`` is written by the background thread (``async_save``)."""
        if not self.async_save or kind != "regular":
            return False
        if snap.sharded:  # written through DCP's collectives, on the training side
            if not getattr(self, "_warned_sync", False):
                self._warned_sync = True
                log.warning("async_save does not cover sharded (FSDP2/DTensor) states yet: saving synchronously")
            return False
        return True

    def _committed(self, final: str, manifest: Manifest, kind: str, tags: list[str], took: float) -> CheckpointInfo:
        """Bookkeeping after a commit (in the training thread): events, log, retention."""
        in_ram = self.run.last_in_ram  # (a RAM save whose folder vanished went to the disk: Run.write)
        info = CheckpointInfo.of(self.run.describe(final, in_ram), final, manifest)
        self.last_saved = info
        self.schedule.saved(manifest.step, manifest.metrics, manifest.progress.get("epoch", 0))
        self.events.publish(Saved(final, info.path, manifest, took, tuple(tags), "ram" if in_ram else "primary"))
        new = self.run.chunks.last.written_bytes if self.run.chunks is not None else None
        log.log(logging.DEBUG if in_ram else logging.INFO,  # RAM saves: often every step
                "saved step %d to %s (%s%.1f MB%s in %.2f s)", manifest.step, info.path,
                "" if kind == "regular" else f"{kind}, ", info.size_bytes / 1e6,
                f", {new / 1e6:.1f} MB of it new" if new is not None else "", took)
        grace = self.preemption.grace_period
        if grace and took > grace and kind == "regular":
            log.warning("a save takes %.1f s, longer than the %.0f s grace period: a preemption save "
                        "would not finish in time", took, grace)
        self.prune(keep=final)
        return info
