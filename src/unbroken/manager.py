"""``Checkpointer``: the run-level API — restore, step, save, discover, retain.

One run folder holds committed checkpoints ``step-000000500/`` (each a folder with a
``manifest.json``), a ``quarantine/`` folder for checkpoints that failed
verification, and transient hidden staging folders. The newest checkpoint is the one
committed last (highest ``seq`` in its manifest), so resuming from an older
checkpoint and training on makes the new branch the newest.

Besides the user's state, every checkpoint holds the loop :class:`Progress` and the
global RNGs under the reserved key ``__unbroken__``; RNGs are restored last.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from .api import CheckpointInfo, read_path
from .discovery import discover, newest_valid
from .environment import POLICIES, fingerprint, json_safe_config
from .environment import check as check_environment
from .errors import NoCheckpointError, UnbrokenError
from .faults import slurm
from .faults.guard import StepGuard
from .faults.handlers import emergency_save, preempt_and_exit
from .faults.signals import DEFAULT_SIGNALS, SignalWatcher
from .persist import write_snapshot
from .probe import ProbeFn, ProbeReport, run_probe
from .probe import compare as compare_probe
from .policies import Retention, Trigger
from .recorder import Recorder
from .scheduling import Schedule
from .tags import check_tag, load_tags, save_tags
from .snapshot import Snapshotter
from .state.apply import apply_state
from .state.checks import UnbrokenWarning, clean_metrics, find_forgotten_state
from .state.rng import GlobalRNG
from .state.stateful import Gradients, Progress
from .storage.local import LocalStorage
from .storage.lock import RunLock

log = logging.getLogger("unbroken")
RESERVED = "__unbroken__"


class Checkpointer:
    """Saves and restores the complete training state of one run.

    Args:
        directory: the run folder (created on the first save).
        save_every: save from :meth:`step` every this many optimizer steps.
        trigger: more save triggers (:mod:`unbroken.policies`: ``EveryMinutes(30) |
            OnImprovement("val_loss")``), combined with ``save_every``; evaluated by
            :meth:`step` and :meth:`end_epoch`.
        keep_last: how many committed checkpoints to keep (``None``: all). Older ones
            are deleted only after a newer one has committed.
        retention: more checkpoints to keep (``KeepBest(2, "val_loss") | KeepEveryNSteps(10_000)``),
            combined with ``keep_last``. Tagged checkpoints are always kept.
        rng: also capture and restore the global python/numpy/torch/CUDA RNGs.
        strict: refuse a checkpoint whose top-level keys differ from the state's.
        signals: on these signals, save at the next :meth:`step` and exit with
            :data:`unbroken.faults.EXIT_PREEMPTED` (default SIGTERM, SIGUSR1, SIGINT;
            ``()`` to leave signals alone). A second identical signal acts at once.
        grace_period: seconds between the signal and the hard kill (e.g. SLURM's
            ``--signal=USR1@120``); a save that takes longer is warned about.
        requeue: after a signal-triggered save inside a SLURM job, ``scontrol requeue`` it.
        probe: a function returning a few numbers from the live state (see
            :func:`unbroken.probe_step`), recorded at every save and recomputed right
            after a restore; the verdict is in :attr:`probe_report` and the log.
        probe_rtol: relative tolerance for "within tolerance" (bitwise equal is "equal").
        config: your hyperparameters (a JSON-like dict), recorded in every manifest.
        data_fingerprint: a dataset identifier (a string), or paths whose sizes and
            mtimes are recorded.
        env_policy: on restore, compare the saved environment (code, versions, config,
            data, world size) with this one: ``"warn"`` logs the differences,
            ``"strict"`` refuses with :class:`EnvironmentMismatchError`, ``"ignore"``.

    The first :meth:`restore`, :meth:`save` or :meth:`step` takes the run folder's
    writer lock (a second process is refused with :class:`RunLockedError`), removes
    leftovers of interrupted saves and installs the signal handlers; :meth:`close`
    (or leaving a ``with`` block) undoes that.
    """

    def __init__(self, directory: str | os.PathLike[str], *, save_every: int | None = None,
                 keep_last: int | None = 3, trigger: Trigger | None = None, retention: Retention | None = None,
                 rng: bool = True, strict: bool = True,
                 signals: tuple[int, ...] = DEFAULT_SIGNALS, grace_period: float | None = None,
                 requeue: bool = False, probe: ProbeFn | None = None, probe_rtol: float = 1e-5,
                 config: Mapping[str, Any] | None = None, data_fingerprint: Any = None,
                 env_policy: str = "warn") -> None:
        self.schedule = Schedule(save_every, trigger, keep_last, retention)
        self.directory = os.fspath(directory)
        self.storage = LocalStorage(self.directory)
        self.save_every, self.keep_last = save_every, keep_last
        self.rng = rng
        self.strict = strict
        self.progress = Progress()
        self.metrics: dict[str, Any] = {}
        self.grace_period = grace_period
        self.requeue = requeue
        if env_policy not in POLICIES:
            raise ValueError(f"env_policy must be one of {POLICIES}")
        if config is not None:
            json_safe_config(config)  # a TypeError naming the bad key now, not at the first save
        self.env_policy = env_policy
        self._config, self._data = config, data_fingerprint
        self._environment: dict[str, Any] | None = None
        self.probe = probe
        self.probe_rtol = probe_rtol
        self.probe_report: ProbeReport | None = None
        self._snapshotter = Snapshotter(copy=False)
        self._checked_state = False
        self._next_seq: int | None = None
        self._lock = RunLock(self.directory)
        self._signals = SignalWatcher(signals)
        self._guard: StepGuard | None = None
        self._last_saved: tuple[int, str] | None = None
        self._wrote_submit = False
        self._recorder: Recorder | None = None

    def _begin(self) -> None:
        """Become this run's writer (idempotent): lock, clean leftovers, watch signals."""
        if self._lock.held:
            return
        self._lock.acquire()
        for name in self.storage.clean_stale():
            log.info("removed leftover %s of an interrupted save", name)
        self._signals.install()
        self._recorder = Recorder(self.directory)

    def close(self) -> None:
        """Release the run folder and restore the previous signal handlers."""
        self._signals.uninstall()
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        self._lock.release()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def guard(self, state: Mapping[str, Any]) -> StepGuard:
        """``with ckpt.guard(state):`` around the training loop: if a step raises, write an
        exact emergency checkpoint first (see :mod:`unbroken.faults.guard`), then re-raise."""
        self._begin()
        return StepGuard(self, state)

    # ----------------------------------------------------------------- discovery
    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints with a readable manifest, newest first (not verified)."""
        return discover(self.storage)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint (not verified), or ``None``."""
        found = self.checkpoints()
        return found[0] if found else None

    # ------------------------------------------------------------------- restore
    def restore(self, state: MutableMapping[str, Any], path: str | os.PathLike[str] | None = None, *,
                tag: str | None = None) -> CheckpointInfo | None:
        """Load the newest valid checkpoint into ``state`` in place; return what was loaded.

        Checkpoints that fail verification are moved to ``quarantine/`` with the reason
        logged, and the previous one is tried. A checkpoint written by a newer unbroken
        raises :class:`NewerFormatError` (it is not corrupt, and falling back past it
        would silently lose progress); I/O errors other than damage propagate too. Returns ``None`` (a fresh start) when the
        run has no valid checkpoint. With ``path``, load exactly that checkpoint and
        raise :class:`CorruptCheckpointError` if it is invalid; with ``tag``, the checkpoint
        of this run carrying that tag.
        """
        self._check_reserved(state)
        self._begin()
        if tag is not None:
            found = [c for c in self.checkpoints() if tag in c.tags]
            if not found:
                raise NoCheckpointError(f"no checkpoint of {self.directory} is tagged {tag!r}")
            path = found[0].path
        if path is not None:
            loaded = read_path(path)
            return self._apply(state, loaded, os.fspath(path))
        bad: list[str] = []

        def invalid(name: str, reason: str) -> None:
            bad.append(name)
            self._record("event", "corruption_found", reason, checkpoint=name)
            self._quarantine(name, reason)

        loaded, seen = newest_valid(self.storage, invalid)
        if loaded is not None:
            if bad:
                log.warning("resuming from %s after skipping %d corrupt newer checkpoint(s)", loaded.name, len(bad))
            return self._apply(state, loaded, self.storage.describe(loaded.name))
        self._record("segment", None, 0)
        if seen or bad:
            log.error("none of the %d checkpoints in %s is valid (all quarantined); starting from scratch",
                      len(bad), self.directory)
        else:
            log.info("no checkpoint in %s; starting from scratch", self.directory)
        return None

    def environment(self) -> dict[str, Any]:
        """This process's environment fingerprint (computed once, at first use)."""
        if self._environment is None:
            self._environment = fingerprint(config=self._config, data=self._data)
        return self._environment

    def _apply(self, state: MutableMapping[str, Any], loaded: Any, where: str) -> CheckpointInfo:
        check_environment(loaded.manifest.environment, self.environment(), self.env_policy)
        saved = dict(loaded.state)
        extra = saved.pop(RESERVED, None)
        apply_state(state, saved, strict=self.strict)
        if isinstance(extra, dict):
            if "progress" in extra:
                self.progress.load_state_dict(getattr(extra["progress"], "value", extra["progress"]))
            if "trigger" in extra:
                self.schedule.load_state_dict(getattr(extra["trigger"], "value", extra["trigger"]))
            if self.rng and "rng" in extra:  # last: nothing may draw from an RNG after this
                GlobalRNG().load_state_dict(getattr(extra["rng"], "value", extra["rng"]))
        if self.probe is not None and loaded.manifest.probe:
            self._check_probe(loaded.manifest.probe)  # in a fork of the RNGs: changes nothing
        self.metrics = dict(loaded.manifest.metrics)
        if os.path.realpath(os.path.dirname(os.path.abspath(where))) == os.path.realpath(self.directory):
            self._record("segment", loaded.name, self.progress.step)
        else:
            self._record("segment", where, self.progress.step)
        log.info("resumed from %s (step %d)", where, loaded.manifest.step)
        return CheckpointInfo.of(where, loaded.name, loaded.manifest)

    def _check_probe(self, saved: dict[str, float]) -> None:
        report = compare_probe(saved, run_probe(self.probe), self.probe_rtol)  # type: ignore[arg-type]
        self.probe_report = report
        level = {"equal": logging.INFO, "within tolerance": logging.WARNING}.get(report.status, logging.ERROR)
        log.log(level, "post-resume %s", report)

    def _quarantine(self, name: str, reason: str) -> None:
        moved = self.storage.quarantine(name, reason)
        if moved:
            self._record("status", name, "quarantined", reason)
            log.warning("checkpoint %s is invalid and was quarantined to %s: %s", name, moved, reason)
        else:
            log.warning("checkpoint %s is invalid (and could not be moved to quarantine/): %s", name, reason)

    # ---------------------------------------------------------------------- save
    def step(self, state: Mapping[str, Any], **metrics: Any) -> CheckpointInfo | None:
        """Mark one optimizer step done; save if it is due. Metrics go into the manifest.

        If a watched signal arrived, save now (if not just saved) and exit with
        :data:`~unbroken.faults.EXIT_PREEMPTED` (``SystemExit``, so ``finally`` blocks run).
        """
        self._begin()
        self.progress.step += 1
        self.progress.micro_step = 0
        self._record("metrics", self.progress.step, metrics)
        # keep tensors as they are (no .item(): that would sync a GPU every step), minus the graph
        self.metrics.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()})
        info = self._maybe_save(state, epoch_end=False)
        if self._signals.received is not None:
            self._preempted(state)
        if self._guard is not None:
            self._guard.mark()
        return info

    def end_epoch(self, state: Mapping[str, Any], **metrics: Any) -> CheckpointInfo | None:
        """Mark the end of an epoch (after validation: pass its metrics); save if a trigger
        asks (``AtEpochEnd()``, ``OnImprovement("val_loss")``). Does not advance the step."""
        self._begin()
        self.metrics.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()})
        return self._maybe_save(state, epoch_end=True)

    def _maybe_save(self, state: Mapping[str, Any], epoch_end: bool) -> CheckpointInfo | None:
        sched = self.schedule
        if not sched.due(self.progress.step, self.progress.epoch, epoch_end, self.metrics):
            return None
        if sched.already_saved(self.progress.step, clean_metrics(self.metrics)):
            return None
        return self.save(state)

    def tag(self, tag: str, checkpoint: str | None = None) -> str:
        """Tag a committed checkpoint (default: the newest); tagged ones are never pruned."""
        check_tag(tag)
        self._begin()
        names = [c.name for c in self.checkpoints()]
        name = checkpoint if checkpoint is not None else (names[0] if names else None)
        if name not in names:
            raise NoCheckpointError(f"no committed checkpoint {name!r} in {self.directory}")
        tags = load_tags(self.directory)
        tags[tag] = name
        save_tags(self.directory, tags)
        self._record("event", "tagged", tag, checkpoint=name)
        return name

    def _preempted(self, state: Mapping[str, Any]) -> None:
        preempt_and_exit(self, state)

    def _emergency_save(self, guard: StepGuard, exc: BaseException | None) -> CheckpointInfo | None:
        """Called by the guard when a step raised (see :mod:`unbroken.faults.guard`)."""
        return emergency_save(self, guard, exc)

    def save(self, state: Mapping[str, Any], metrics: dict[str, Any] | None = None, *,
             kind: str = "regular", tag: str | None = None) -> CheckpointInfo:
        """Save ``state`` (plus progress and RNG) now, synchronously, then apply retention.
        A ``tag`` names the checkpoint and protects it from retention."""
        self._check_reserved(state)
        self._begin()
        if metrics:
            self.metrics.update(metrics)
        if not self._checked_state:
            self._checked_state = True
            for message in find_forgotten_state(state):
                warnings.warn(message, UnbrokenWarning, stacklevel=2)
        if self.progress.micro_step and not any(isinstance(v, Gradients) for v in state.values()):
            warnings.warn(
                f"saving in the middle of gradient accumulation (micro_step={self.progress.micro_step}) "
                "without the accumulated gradients; add unbroken.Gradients(model) to the state",
                UnbrokenWarning, stacklevel=2)
        tags = [check_tag(tag)] if tag else []
        return self._write(state, self.progress.state_dict(), GlobalRNG() if self.rng else None, kind, tags)

    def _write(self, state: Mapping[str, Any], progress: dict[str, int], rng: Any, kind: str,
               tags: list[str] | None = None) -> CheckpointInfo:
        full: dict[str, Any] = dict(state)
        full[RESERVED] = {"progress": dict(progress)}
        if self.schedule.trigger is not None:
            full[RESERVED]["trigger"] = self.schedule.state_dict()
        if rng is not None:
            full[RESERVED]["rng"] = rng
        t0 = time.monotonic()
        probe = run_probe(self.probe) if self.probe is not None and kind != "emergency" else None
        snapshot = self._snapshotter.capture(full)
        seq = self._seq()
        final, manifest = write_snapshot(
            snapshot, self.storage, f"step-{progress['step']:09d}", step=progress["step"], seq=seq,
            metrics=clean_metrics(self.metrics), progress=dict(progress), environment=self.environment(), kind=kind,
            probe=probe, tags=tags)
        took = time.monotonic() - t0
        self._next_seq = seq + 1
        self._last_saved = (progress["step"], final)
        info = CheckpointInfo.of(self.storage.describe(final), final, manifest)
        self.schedule.saved(progress["step"], manifest.metrics)
        self._record("saved", final, manifest, took, list(tags or []))
        log.info("saved %s (%s, %.1f MB in %.2f s)", info.path, kind, info.size_bytes / 1e6, took)
        if self.grace_period and took > self.grace_period and kind == "regular":
            log.warning("a save takes %.1f s, longer than the %.0f s grace period: a preemption save "
                        "would not finish in time", took, self.grace_period)
        if not self._wrote_submit and slurm.job_id():
            self._wrote_submit = True
            log.info("wrote %s", slurm.write_submit_script(self.directory))
        self.prune(keep=final)
        return info

    def _seq(self) -> int:
        # re-read every time: cheap (manifests only), and right even if the folder changed
        on_disk = max((c.seq for c in self.checkpoints()), default=-1) + 1
        return max(on_disk, self._next_seq or 0)

    def prune(self, keep: str | None = None) -> list[str]:
        """Apply retention: delete committed checkpoints no rule keeps (never the newest)."""
        infos = self.checkpoints()
        doomed = self.schedule.doomed(infos, {c.name: set(c.tags) for c in infos}, keep)
        for name in doomed:
            self.storage.delete(name)
            self._record("status", name, "pruned", "retention")
            log.info("retention: deleted %s", name)
        return doomed

    def _record(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Forward to the run index, if this process is the run's writer (never raises)."""
        if self._recorder is not None:
            getattr(self._recorder, method)(*args, **kwargs)

    @staticmethod
    def _check_reserved(state: Mapping[str, Any]) -> None:
        if RESERVED in state:
            raise UnbrokenError(f"the state key {RESERVED!r} is reserved for unbroken; rename it")
