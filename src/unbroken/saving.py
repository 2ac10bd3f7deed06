"""The save path of :meth:`unbroken.Checkpointer.save`: capture, write (now or in the background),
and the bookkeeping after a commit (events, the log line, retention), in the training thread.

Split out of :mod:`unbroken.manager` (which keeps the public method and its documentation); these
functions read and set the Checkpointer's own attributes and are called by it alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from .api import CheckpointInfo
from .dist.comm import Comm
from .events import Saved
from .format.manifest import Manifest
from .lazy import StepGate, step_only_storages
from .probe import run_probe
from .restoring import sync_data_position
from .saved_state import split
from .state.checks import clean_metrics
from .tags import check_tag
from .adapting import adapt

log = logging.getLogger("unbroken")


def save(ckpt: Any, state: Mapping[str, Any], metrics: dict[str, Any] | None, kind: str, tag: str | None,
         progress: Mapping[str, int] | None, rng: Mapping[str, Any] | None) -> CheckpointInfo | None:
    """The body of :meth:`unbroken.Checkpointer.save` (see there)."""
    state = adapt(state)
    ckpt.rules.check_reserved(state)
    ckpt._begin()
    ckpt.flush(raise_errors=kind == "regular")  # backpressure: at most one save in flight
    if metrics:
        ckpt.metrics.update(metrics)
    ckpt.rules.validate(state)
    ckpt.rules.before_save(state, ckpt.progress.micro_step, ckpt.progress.step)
    tags = [check_tag(tag)] if tag else []
    if progress is None:
        sync_data_position(ckpt.progress, state)
    prog = dict(progress) if progress is not None else ckpt.progress.state_dict()
    state = ckpt.saved_part(state)
    shared, mine = split(state, prog, ckpt.schedule.state_dict() if ckpt.schedule.trigger is not None else None,
                         ckpt.rng, rng)
    if ckpt._recorder is not None:  # the metric rows up to this checkpoint are durable before it commits
        ckpt._recorder.durable(prog["step"], sync=not ckpt.run.saves_to_ram(kind))
    t0 = time.monotonic()
    probe = run_probe(ckpt.probe) if ckpt.probe is not None and kind != "emergency" else None
    lazy = ckpt.async_save == "lazy" and kind == "regular"
    snap, rank_snap = (ckpt._snapshotter.capture(shared, defer=step_only_storages(state) if lazy else frozenset()),
                       ckpt._rank_snapshotter.capture(mine, prefix=f"r{ckpt.comm.rank:05d}-"))
    fields = dict(step=prog["step"], metrics=clean_metrics(ckpt.metrics), progress=prog,
                  environment=ckpt.environment(), kind=kind, probe=probe or {}, tags=tags)

    def write(broken: BaseException | None = None, comm: Comm = ckpt._save_comm) -> tuple[str, Manifest, float]:
        final, manifest = ckpt.run.write(snap, rank_snap, f"step-{prog['step']:09d}", comm, broken, **fields)
        return final, manifest, time.monotonic() - t0

    if in_background(ckpt, kind, snap):
        ckpt.schedule.saved(prog["step"], fields["metrics"], prog.get("epoch", 0))
        gate = StepGate([snap]) if snap.deferred or snap.lazy_events else None
        ckpt._background.submit(write, (kind, tags), gate)
        log.debug("step %d copied in %.3f s; writing in the background", prog["step"], time.monotonic() - t0)
        return None
    final, manifest, took = write(comm=ckpt.comm)
    return committed(ckpt, final, manifest, kind, tags, took)


def in_background(ckpt: Any, kind: str, snap: Any) -> bool:
    """Whether a save of ``kind`` is written by the background thread (``async_save``)."""
    if not ckpt.async_save or kind != "regular":
        return False
    if snap.sharded:  # written through DCP's collectives, on the training side
        if not getattr(ckpt, "_warned_sync", False):
            ckpt._warned_sync = True
            log.warning("async_save does not cover sharded (FSDP2/DTensor) states yet: saving synchronously")
        return False
    return True

def committed(ckpt: Any, final: str, manifest: Manifest, kind: str, tags: list[str], took: float) -> CheckpointInfo:
    """Bookkeeping after a commit (in the training thread): events, log, retention."""
    info = CheckpointInfo.of(ckpt.run.describe(final), final, manifest)
    ckpt.last_saved = info
    ckpt.schedule.saved(manifest.step, manifest.metrics, manifest.progress.get("epoch", 0))
    in_ram = ckpt.run.in_ram(final)
    ckpt.events.publish(Saved(final, info.path, manifest, took, tuple(tags), "ram" if in_ram else "primary"))
    new = ckpt.run.chunks.last.written_bytes if ckpt.run.chunks is not None else None
    log.log(logging.DEBUG if in_ram else logging.INFO,  # RAM saves: often every step
            "saved step %d to %s (%s%.1f MB%s in %.2f s)", manifest.step, info.path,
             "" if kind == "regular" else f"{kind}, ", info.size_bytes / 1e6,
             f", {new / 1e6:.1f} MB of it new" if new is not None else "", took)
    grace = ckpt.preemption.grace_period
    if grace and took > grace and kind == "regular":
        log.warning("a save takes %.1f s, longer than the %.0f s grace period: a preemption save "
                    "would not finish in time", took, grace)
    ckpt.prune(keep=final)
    return info
