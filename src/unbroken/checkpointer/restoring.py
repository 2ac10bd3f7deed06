"""Putting a loaded checkpoint into the live state, on every rank, in a fixed order.

1. Sharded tensors (DTensors of FSDP2 models and their optimizers) are loaded into the
   live shards through DCP (:func:`unbroken.dist.sharded.load_sharded`), whatever
   sharding they were saved with; an optimizer that has not stepped yet is given its
   state first, so there is a shard to load into. Where the live state holds a plain
   tensor (one process, no FSDP), the full tensor is loaded.
2. The shared state goes into the live objects (``load_state_dict``, in place), then this
   rank's :class:`~unbroken.PerRank` objects.
3. The RNGs, last. **The rule**: same world size, every rank gets its own RNG states back;
   a different world size (or a rank the checkpoint did not have), every rank reseeds its
   python, numpy, torch and CUDA generators from ``(seq, step, rank, world_size)`` of the
   checkpoint, so the resumed run is bitwise reproducible given the new world size.
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from .._support.console import announce
from ..api import RESERVED, CheckpointInfo, read_path
from ..checkpoint.chunks import LiveChunks
from ..checkpoint.reader import LoadedCheckpoint, ShardedRef, contains_sharded, substitute
from ..data.loader import ResumableLoader
from ..errors import NoCheckpointError, NoValidCheckpointError
from ..events import Restored, Started
from ..state.adapters import Adapter
from ..state.apply import apply_parts as apply_all
from ..state.apply import check_keys, check_state
from ..state.codec import StatefulValue, is_sharded
from ..state.rng import GlobalRNG
from ..state.stateful import PerRank, Progress, is_stateful
from .environment import check as check_environment
from .probe import check_after_resume

if TYPE_CHECKING:
    from .core import Core  # (it imports the state rules, which import this module)

log = logging.getLogger("unbroken")


def _pair(saved: Any, live: Any, out: dict[str, torch.Tensor]) -> None:
    """Find the live tensor at the place of every sharded reference in ``saved``."""
    if isinstance(saved, ShardedRef):
        if isinstance(live, torch.Tensor) or is_sharded(live):
            out[saved.fqn] = live
        return
    if isinstance(saved, StatefulValue):
        saved = saved.value
    if isinstance(saved, dict) and isinstance(live, dict):
        for k, v in saved.items():
            if k in live:
                _pair(v, live[k], out)
    elif isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        for a, b in zip(saved, live, strict=True):
            _pair(a, b, out)


def load_sharded_parts(live: MutableMapping[str, Any], saved: dict[str, Any], loaded: LoadedCheckpoint,
                       group: Any) -> dict[str, Any]:
    """``saved`` with every sharded reference replaced by a live tensor that now holds the
    saved values (see the module docstring, step 1). A collective when it has any."""
    if not contains_sharded(saved):
        return saved
    from ..dist.sharded import assemble, load_sharded  # DCP: imported only for sharded states (~0.1 s)

    targets: dict[str, torch.Tensor] = {}
    for key, value in saved.items():
        obj = live.get(key)
        if not contains_sharded(value) or obj is None:
            continue
        if isinstance(obj, torch.optim.Optimizer) and not obj.state:
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(obj)  # a shard to load into (overwritten by the load)
        if isinstance(obj, Adapter):
            obj.prepare_load(value.value if isinstance(value, StatefulValue) else value)
        _pair(value, obj.state_dict() if is_stateful(obj) else obj, targets)
    metadata = loaded.sharded_metadata()
    assert loaded.files is not None
    load_sharded(targets, metadata, group, loaded.files.tensors)
    return substitute(saved, lambda ref: targets[ref.fqn] if ref.fqn in targets
                      else assemble(ref.fqn, metadata, loaded.files.tensors))


def check_all(state: MutableMapping[str, Any], saved: dict[str, Any], mine: dict[str, Any] | None,
              per_rank: list[str], strict: bool) -> None:
    """Everything that can be checked before anything is loaded: the keys of the shared state
    and of this rank's per-rank objects, and the fit of every part (:func:`check_state`)."""
    live_per_rank = [k for k, v in state.items() if isinstance(v, PerRank)]
    shared_live = {k: v for k, v in state.items() if not isinstance(v, PerRank)}
    check_keys(shared_live, saved, strict)
    check_keys(dict.fromkeys(live_per_rank), dict.fromkeys(per_rank), strict)
    check_state(shared_live, saved)
    if mine is not None:
        check_state({k: state[k] for k in live_per_rank}, {k: v for k, v in mine.items() if k in live_per_rank})


def apply_parts(state: MutableMapping[str, Any], saved: dict[str, Any], mine: dict[str, Any] | None,
                per_rank: list[str], rank: int, between: Any = None) -> None:
    """Step 2: the shared state and this rank's per-rank objects into ``state`` in place, all or
    nothing (:func:`unbroken.state.apply.apply_parts`); ``between`` loads the sharded tensors."""
    live_per_rank = [k for k, v in state.items() if isinstance(v, PerRank)]
    shared_live = {k: v for k, v in state.items() if not isinstance(v, PerRank)}
    mine_live = {k: state[k] for k in live_per_rank if mine is not None and k in mine}
    for key in live_per_rank:
        if key not in mine_live and key in per_rank:
            warnings.warn(f"rank {rank} has no saved state for PerRank state[{key!r}] (the checkpoint was "
                          "written by fewer ranks); it keeps its current state", stacklevel=4)
    apply_all([(shared_live, saved), (mine_live, {k: mine[k] for k in mine_live} if mine else {})], between,
              late=contains_sharded)
    state.update(shared_live)  # plain values are replaced, objects were loaded in place


def _rng_to_load(loaded: LoadedCheckpoint, shared_rng: Any, world: int) -> Any:
    """The saved global-RNG state :func:`restore_rng` sets, or ``None`` when it reseeds."""
    own = (loaded.rank_state or {}).get("rng")
    own = getattr(own, "value", own)
    if own is not None and loaded.manifest.world_size == world:
        return own
    if own is None and shared_rng is not None and world == 1 and loaded.manifest.world_size == 1:
        return getattr(shared_rng, "value", shared_rng)  # format 1
    return None


def check_parts(loaded: LoadedCheckpoint, extra: dict[str, Any], world: int, rng: bool) -> None:
    """Before anything is loaded: the saved progress counters and the RNG state that will be set
    are valid (a checksum-valid file may still hold anything), so a bad one fails the restore
    with nothing changed instead of half-way."""
    if "progress" in extra:
        Progress.check(extra["progress"])
    if rng:
        state = _rng_to_load(loaded, extra.get("rng"), world)
        if state is not None:
            GlobalRNG.check(state)


def restore_rng(loaded: LoadedCheckpoint, shared_rng: Any, rank: int, world: int) -> str:
    """Step 3 (see the module docstring); returns how the RNGs were restored."""
    saved_world = loaded.manifest.world_size
    state = _rng_to_load(loaded, shared_rng, world)
    if state is not None:
        GlobalRNG().load_state_dict(state)
        return "restored"
    m = loaded.manifest
    seed = xxhash.xxh64_intdigest(f"unbroken-rng:{m.seq}:{m.step}:{rank}:{world}".encode())
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CPU and every CUDA device
    return f"reseeded (world size {saved_world} -> {world})"


def sync_data_position(progress: Progress, state: Mapping[str, Any]) -> None:
    """Progress has one owner: with a ResumableLoader in the state, the epoch and the global
    samples consumed are the loader's, never copied by hand."""
    loaders = [v for v in state.values() if isinstance(v, ResumableLoader)]
    if len(loaders) == 1:
        progress.epoch, progress.samples = loaders[0].epoch, loaders[0].samples_seen


def apply_checkpoint(core: Core, state: MutableMapping[str, Any], loaded: LoadedCheckpoint,
                     where: str, tier: str = "path") -> CheckpointInfo:
    """Load ``loaded`` into ``state`` and into the Checkpointer's ``core`` (its progress, trigger,
    metrics), in the order of the module docstring: everything is checked before anything is
    applied, RNGs come last. Publishes ``Restored``; returns what was loaded (its ``tiers``: the
    one it was read from, ``ram``, ``local``, ``remote``, or ``path`` for a checkpoint named by path)."""
    check_environment(loaded.manifest.environment, core.environment(), core.env.policy)
    comm = core.comm
    saved = {k: v for k, v in loaded.state.items() if k not in core.rules.allow_unsaved}
    popped = saved.pop(RESERVED, None)
    extra: dict[str, Any] = popped if isinstance(popped, dict) else {}
    check_parts(loaded, extra, comm.world, core.rng)
    live = core.saved_part(state)  # the allow_unsaved keys are neither saved nor restored
    mine = (loaded.rank_state or {}).get("state")
    mine = mine if isinstance(mine, dict) else None
    per_rank = list(extra.get("per_rank", []))
    check_all(live, saved, mine, per_rank, core.strict)  # nothing is loaded before every part is checked

    def sharded() -> None:  # after the objects that may refuse: a refused restore changed nothing
        saved.update(load_sharded_parts(live, saved, loaded, comm.group))

    apply_parts(live, saved, mine, per_rank, comm.rank, sharded)
    state.update(live)
    if "progress" in extra:
        core.progress.load_state_dict(getattr(extra["progress"], "value", extra["progress"]))
    if "trigger" in extra:
        core.schedule.load_state_dict(getattr(extra["trigger"], "value", extra["trigger"]))
    rng = restore_rng(loaded, extra.get("rng"), comm.rank, comm.world) if core.rng else "not restored"
    sync_data_position(core.progress, state)
    if loaded.manifest.world_size != comm.world:
        log.warning("world size changed from %d to %d: sharded tensors resharded, the data continues at global "
                    "sample %d of epoch %d, RNGs %s", loaded.manifest.world_size, comm.world,
                    core.progress.samples, core.progress.epoch, rng)
    if core.probe is not None and loaded.manifest.probe:  # in a fork of the RNGs: changes nothing
        core.probe_report = check_after_resume(core.probe, loaded.manifest.probe)
    core.metrics = dict(loaded.manifest.metrics)
    in_run = where == core.run.describe(loaded.name)
    core.events.publish(Restored(loaded.name if in_run else where, where, core.progress.step, tier))
    announce("resumed from %s (step %d)", where, loaded.manifest.step)  # whatever the logging configuration
    return CheckpointInfo.of(where, loaded.name, loaded.manifest, tiers=(tier,))


def restore_into(core: Core, state: MutableMapping[str, Any], path: Any, tag: str | None,
                 if_unrestorable: str) -> CheckpointInfo | None:
    """The body of :meth:`unbroken.Checkpointer.restore` once the run is open (see there). The
    environment is fingerprinted in a thread while the checkpoint is read (:meth:`Core.fingerprint_meanwhile`)."""
    core.fingerprint_meanwhile()
    try:
        return _restore_into(core, state, path, tag, if_unrestorable)
    finally:
        core.join_fingerprint()


def _restore_into(core: Core, state: MutableMapping[str, Any], path: Any, tag: str | None,
                  if_unrestorable: str) -> CheckpointInfo | None:
    if tag is not None:
        found = [c for c in core.run.checkpoints() if tag in c.tags]
        if not found:
            raise NoCheckpointError(f"no checkpoint of {core.location} is tagged {tag!r}")
        path = found[0].path
    if path is not None:
        opts = core.storage_options if isinstance(path, str) and "://" in path else None
        named = read_path(path, opts, core.comm.rank)
        core.run.use_base(named, path)
        return apply_checkpoint(core, state, named, os.fspath(path))
    # a read-only run is not written, not even to repair a chunk
    repair = LiveChunks(core.run.store, core.saved_part(state)) if core.run.chunks is not None and \
        not core.run.readonly else None
    loaded, where, tier = core.run.newest_valid(repair)
    if loaded is not None:
        return apply_checkpoint(core, state, loaded, where, tier)
    lost = core.run.unrestorable()
    if lost and if_unrestorable != "start_fresh" and os.environ.get("UNBROKEN_START_FRESH") != "1":
        raise NoValidCheckpointError(unrestorable_message(core.location, lost))
    core.events.publish(Started(None, 0))
    if lost:
        core.run.acknowledge(lost)
        log.warning("starting %s from scratch on purpose, past %d checkpoint(s) that could not be restored (kept "
                    "where they are, in quarantine/ if they could be moved)", core.location, len(lost))
    else:
        announce("no checkpoint in %s; starting from scratch", core.location)
    return None


def unrestorable_message(location: str, lost: list[tuple[str, str]]) -> str:
    """The message of :class:`~unbroken.errors.NoValidCheckpointError`: every checkpoint that could
    not be restored with its damage, and the ways forward."""
    shown = [f"  - {where}: {reason if len(reason) <= 300 else reason[:297] + '...'}" for where, reason in lost[:20]]
    if len(lost) > 20:
        shown.append(f"  - ... and {len(lost) - 20} more")
    return (f"{location} has checkpoints, but none of them can be restored; refusing to start again from step 0 "
            "(that would silently lose the run's progress):\n" + "\n".join(shown) + "\n"
            "What to do: restore a copy from elsewhere (another tier, a backup) or a specific checkpoint with "
            "restore(state, path=...); `unbroken verify RUN` shows the damage. To start from scratch on purpose, "
            "call restore(state, if_unrestorable=\"start_fresh\") or set UNBROKEN_START_FRESH=1 (the damaged "
            "checkpoints stay in quarantine/).")
