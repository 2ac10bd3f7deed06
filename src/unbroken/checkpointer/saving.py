"""The save path of the :class:`~unbroken.Checkpointer`: capture, write (now or in the background),
and the bookkeeping after a commit (events, the log line, retention), in the training thread.

:class:`Saver` is the Checkpointer's part that saves: built with the :class:`~unbroken.checkpointer.core.Core` the
parts share, it owns what only saving uses (the two snapshotters that capture a state, the background
saves in flight, the writer process, and the group background saves commit over).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from ..api import CheckpointInfo
from ..checkpoint.background.filewriter import FileWriter, snapshotters
from ..checkpoint.background.lazy import StepGate, step_only_storages
from ..checkpoint.background.thread import BackgroundSaves
from ..checkpoint.tags import check_tag
from ..dist.comm import Comm
from ..errors import ConfigurationError
from ..events import Saved, StartedOver
from ..format.manifest import Manifest
from ..state.checks import clean_metrics
from .core import Core
from .probe import run_probe
from .restoring import sync_data_position
from .saved_state import split

log = logging.getLogger("unbroken")


class Saver:
    """The save path of :class:`~unbroken.Checkpointer` (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        # a background save needs its own copy, in shared memory for the writer process (background/filewriter.py)
        shared, mine, writer = snapshotters(core.async_save)
        self.snapshotter, self.rank_snapshotter = shared, mine
        self.file_writer: FileWriter | None = writer
        self.background: BackgroundSaves[tuple[str, list[str]], tuple[str, Manifest, float]] = BackgroundSaves()
        # several ranks: background saves run their collectives over a group of their own
        self.save_comm = Comm() if core.async_save and core.comm.world > 1 else core.comm
        self._warned_sync = False

    def refuse_starting_over(self, kind: str, on_purpose: bool = False) -> None:
        """The first save of a process that never called ``restore()``: refused, before anything is
        written or deleted, if the run already has checkpoints (a forgotten ``restore()``, an ``if
        args.resume:`` without the flag): it would start again at step 0 under newer sequence numbers,
        and retention would delete the run's real checkpoints. ``start_fresh()`` (``on_purpose``) or
        ``UNBROKEN_START_FRESH=1`` starts over on purpose (logged, and recorded in the run index as a
        ``started_over`` event). The coordinator
        lists the run (every tier) and tells the other ranks, so every rank decides alike (the first
        save is collective: nothing else is in flight on the group)."""
        core = self.core
        if kind == "imported":  # ``unbroken import`` writes the run's first checkpoint itself
            core.started = True
            return
        found: list[Any] | str | None = None
        if core.comm.coordinator:
            try:
                listed = core.run.checkpoints()
                found = [len(listed), max(c.step for c in listed)] if listed else None
            except Exception as e:  # noqa: BLE001 - said on every rank below, never a hang of the others
                found = f"{type(e).__name__}: {e}"
        found = core.comm.broadcast(found)
        if isinstance(found, str):
            raise ConfigurationError(f"cannot tell whether {core.location} already has checkpoints before this "
                                     f"process's first save (it never called restore()): {found}")
        if found is None:
            core.started = True
            return
        count, newest = found
        why = "start_fresh()" if on_purpose else "UNBROKEN_START_FRESH=1"
        if not on_purpose and os.environ.get("UNBROKEN_START_FRESH") != "1":
            raise ConfigurationError(
                f"{core.location} already has {count} checkpoint(s), the newest at step {newest}, and this "
                f"process is saving without having called restore(): it would start over (it is at step "
                f"{core.progress.step}) and retention would delete those checkpoints. Call ckpt.restore(state) "
                f"before training (it resumes from step {newest}); to start over on purpose, call "
                "ckpt.start_fresh() instead, use a new run location, or set UNBROKEN_START_FRESH=1.")
        log.warning("%s: %s starts over without restoring (at step %d); its %d checkpoint(s) (newest at step %d) "
                    "go as retention replaces them", why, core.location, core.progress.step, count, newest)
        core.events.publish(StartedOver(core.progress.step, count, newest, why))
        core.started = True

    def save(self, state: Mapping[str, Any], metrics: dict[str, Any] | None = None, *, kind: str = "regular",
             tag: str | None = None, progress: Mapping[str, int] | None = None,
             rng: Mapping[str, Any] | None = None) -> CheckpointInfo | None:
        """:meth:`unbroken.Checkpointer.save` once the state is adapted and the run open (see there). The time
        it blocks training (all of it for a synchronous save, the snapshot for an async one, with the wait for
        the previous background save) goes to the run index (``unbroken goodput``)."""
        entered, done = time.monotonic(), False
        try:
            info = self._save(state, metrics, kind=kind, tag=tag, progress=progress, rng=rng)
            done = True
            return info
        finally:
            core, now = self.core, time.monotonic()
            step = progress["step"] if progress is not None and "step" in progress else core.progress.step
            if core.recorder is not None:
                core.recorder.save_blocked(step, now - entered)
            if done and core.schedule.auto and kind != "emergency":  # save_every="auto" learns what a save costs
                said = core.schedule.observe_save(now - entered, now)
                if said and core.recorder is not None:
                    core.recorder.event("save_interval", said, step=step, data={"seconds": core.schedule.chosen_s})

    def _save(self, state: Mapping[str, Any], metrics: dict[str, Any] | None, *, kind: str, tag: str | None,
              progress: Mapping[str, int] | None, rng: Mapping[str, Any] | None) -> CheckpointInfo | None:
        core = self.core
        core.rules.check_reserved(state)
        if not core.started:
            self.refuse_starting_over(kind)
        self.flush(raise_errors=kind == "regular")  # backpressure: at most one save in flight
        if metrics:
            core.metrics.update(metrics)
        core.rules.validate(state)
        core.rules.before_save(state, core.progress.micro_step, core.progress.step)
        tags = [check_tag(tag)] if tag else []
        if progress is None:
            sync_data_position(core.progress, state)
        prog = dict(progress) if progress is not None else core.progress.state_dict()
        state = core.saved_part(state)
        shared, mine = split(state, prog, core.schedule.state_dict() if core.schedule.trigger is not None else None,
                             core.rng, rng)
        if core.recorder is not None:  # the metric rows up to this checkpoint are durable before it commits
            core.recorder.durable(prog["step"], sync=not core.run.saves_to_ram(kind))
        t0 = time.monotonic()
        probe = run_probe(core.probe) if core.probe is not None and kind != "emergency" else None
        lazy = core.async_save == "lazy" and kind == "regular"
        snap, rank_snap = (self.snapshotter.capture(shared, defer=step_only_storages(state) if lazy else frozenset()),
                           self.rank_snapshotter.capture(mine, prefix=f"r{core.comm.rank:05d}-"))
        metrics_now = clean_metrics(core.metrics)
        fields = dict(step=prog["step"], metrics=metrics_now, progress=prog, environment=core.environment(),
                      kind=kind, probe=probe or {}, tags=tags)

        def write(broken: BaseException | None = None, comm: Comm = self.save_comm) -> tuple[str, Manifest, float]:
            final, manifest = core.run.write(snap, rank_snap, f"step-{prog['step']:09d}", comm, broken, **fields)
            return final, manifest, time.monotonic() - t0

        if self._in_background(kind, snap):
            if self.writer_process(kind):
                snap.writer = rank_snap.writer = self.file_writer
            core.schedule.saved(prog["step"], metrics_now, prog.get("epoch", 0))
            gate = StepGate([snap]) if snap.deferred or snap.lazy_events else None
            self.background.submit(write, (kind, tags), gate)
            log.debug("step %d copied in %.3f s; writing in the background", prog["step"], time.monotonic() - t0)
            return None
        final, manifest, took = write(comm=core.comm)
        return self._committed(final, manifest, kind, tags, took)

    def flush(self, raise_errors: bool = True) -> CheckpointInfo | None:
        """:meth:`unbroken.Checkpointer.flush` (see there)."""
        try:
            done = self.background.collect()
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
        """Stop the background thread and the writer process (after :meth:`flush`)."""
        self.background.shutdown()
        if self.file_writer is not None:
            self.file_writer.close()
        self.save_comm.close()

    def writer_process(self, kind: str = "regular") -> bool:
        """Whether a background save of ``kind`` is written by the writer process (a full checkpoint
        into a local folder, see :mod:`unbroken.checkpoint.background.filewriter`); if so, it is started (from the
        training
        thread: it lives as long as the thread that started it) if it is not running."""
        run = self.core.run
        if self.file_writer is None or run.readonly or run.chunks is not None or not run.on_local_disk(kind):
            return False
        self.file_writer.start()
        return True

    def _in_background(self, kind: str, snap: Any) -> bool:
        """Whether a save of ``kind`` is written by the background thread (``async_save``)."""
        if not self.core.async_save or kind != "regular":
            return False
        if snap.sharded:  # written through DCP's collectives, on the training side
            if not self._warned_sync:
                self._warned_sync = True
                log.warning("async_save does not cover sharded (FSDP2/DTensor) states yet: saving synchronously")
            return False
        return True

    def _committed(self, final: str, manifest: Manifest, kind: str, tags: list[str], took: float) -> CheckpointInfo:
        """Bookkeeping after a commit (in the training thread): events, log, retention."""
        core = self.core
        in_ram = core.run.last_in_ram  # (a RAM save whose folder vanished went to the disk: Run.write)
        info = CheckpointInfo.of(core.run.describe(final, in_ram), final, manifest)
        core.last_saved = info
        core.schedule.saved(manifest.step, manifest.metrics, manifest.progress.get("epoch", 0))
        core.events.publish(Saved(final, info.path, manifest, took, tuple(tags), "ram" if in_ram else "primary"))
        new = core.run.chunks.last.written_bytes if core.run.chunks is not None else None
        log.log(logging.DEBUG if in_ram else logging.INFO,  # RAM saves: often every step
                "saved step %d to %s (%s%.1f MB%s in %.2f s)", manifest.step, info.path,
                "" if kind == "regular" else f"{kind}, ", info.size_bytes / 1e6,
                f", {new / 1e6:.1f} MB of it new" if new is not None else "", took)
        grace = core.preemption.grace_period
        if grace and took > grace and kind == "regular":
            log.warning("a save takes %.1f s, longer than the %.0f s grace period: a preemption save "
                        "would not finish in time", took, grace)
        core.run.prune(core.schedule, keep=final)
        return info
