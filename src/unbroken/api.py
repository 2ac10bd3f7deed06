"""Single-checkpoint functions: ``save``, ``load`` and ``verify`` a checkpoint folder.

These work on one folder and add nothing to the state; :class:`unbroken.Checkpointer`
builds runs on top of them (progress, RNG, discovery, retention).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from typing import Any, Literal, overload

from ._support.exithooks import at_process_exit
from .checkpoint.adapting import adapt
from .checkpoint.background.thread import in_thread
from .checkpoint.manifests import CheckpointInfo, is_run
from .checkpoint.persist import write_snapshot
from .checkpoint.reader import LoadedCheckpoint, read_checkpoint, vanished, verify_all
from .checkpoint.snapshot import Snapshotter
from .errors import NoCheckpointError, UnbrokenError
from .state.apply import apply_state
from .state.checks import clean_metrics
from .state.codec import StatefulValue
from .store import open_store, split_checkpoint


class PendingSave:
    """A checkpoint being written in the background (``unbroken.save(..., async_save=True)``).

    :meth:`wait` returns its :class:`CheckpointInfo` or raises its error. A failure nobody
    waited for is raised by the next ``unbroken.save``; at interpreter exit the save in flight
    is waited for, and a failure is logged as an error (the exit cannot raise)."""

    def __init__(self, path: str, future: Future[CheckpointInfo]) -> None:
        self.path = path
        self._future = future
        self._seen = False

    def done(self) -> bool:
        """True once the checkpoint is committed or the save failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the commit; the checkpoint's info, or the save's error raised here."""
        self._seen = True
        return self._future.result(timeout)


_inflight: PendingSave | None = None
_inflight_lock = threading.Lock()
_staging = Snapshotter(copy=True)  # host buffers reused by background saves, one at a time
log = logging.getLogger("unbroken")
RELISTS = 10
"""How often :func:`read_run` looks for the newest checkpoint again after the one it read was pruned."""
RESERVED = "__unbroken__"
"""The top-level key under which a Checkpointer keeps its own state (progress, trigger, RNGs)."""


def _wait_inflight(raise_unseen: bool) -> None:
    global _inflight
    with _inflight_lock:
        pending, _inflight = _inflight, None
    if pending is None:
        return
    try:
        pending._future.result()
    except Exception as e:
        if raise_unseen and not pending._seen:
            raise
        if not pending._seen:
            log.error("the background save of %s failed and was not committed: %s: %s",
                      pending.path, type(e).__name__, e)


def _forget_in_child() -> None:
    """A forked child does not own its parent's background save (its thread is not in the child)."""
    global _inflight, _inflight_lock
    _inflight, _inflight_lock = None, threading.Lock()


@at_process_exit(forget=_forget_in_child)
def _wait_at_exit() -> None:
    _wait_inflight(raise_unseen=False)


@overload
def save(path: str | os.PathLike[str], state: Mapping[str, Any], *, step: int = ...,
         metrics: dict[str, Any] | None = ..., storage_options: Mapping[str, Any] | None = ...,
         async_save: Literal[False] = ...) -> CheckpointInfo: ...
@overload
def save(path: str | os.PathLike[str], state: Mapping[str, Any], *, step: int = ...,
         metrics: dict[str, Any] | None = ..., storage_options: Mapping[str, Any] | None = ...,
         async_save: Literal[True]) -> PendingSave: ...
def save(path: str | os.PathLike[str], state: Mapping[str, Any], *, step: int = 0,
         metrics: dict[str, Any] | None = None, storage_options: Mapping[str, Any] | None = None,
         async_save: bool = False) -> CheckpointInfo | PendingSave:
    """Write ``state`` atomically as the checkpoint ``path`` (a folder or a URL; must not exist).

    Saves exactly what is given: use :class:`Checkpointer` to include RNG and progress.
    With ``async_save=True`` the state is copied into host buffers and a :class:`PendingSave`
    is returned at once; writing and committing go on in a background thread. At most one
    such save is in flight per process: the next ``save`` waits for it first (and raises its
    error if nobody waited for it), and the interpreter's exit waits for it.
    """
    global _inflight
    _wait_inflight(raise_unseen=True)
    store, name = split_checkpoint(path, storage_options)
    if name in store.list_committed() or (not store.remote and os.path.lexists(os.fspath(path))):
        raise FileExistsError(f"{path} already exists; choose a new checkpoint path")
    snap = (_staging if async_save else Snapshotter()).capture(adapt(state))
    clean = clean_metrics(dict(metrics or {}))

    def write() -> CheckpointInfo:
        final, manifest = write_snapshot(snap, store, name, step=step, seq=0, metrics=clean)
        return CheckpointInfo.of(store.describe(final), final, manifest)

    if not async_save:
        return write()
    future, _ = in_thread(write)
    pending = PendingSave(os.fspath(path), future)
    with _inflight_lock:
        _inflight = pending
    return pending


def read_path(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
              rank: int = 0) -> LoadedCheckpoint:
    """Verify and decode the checkpoint at ``path`` for ``rank`` (NoCheckpointError if there is none)."""
    store, name = split_checkpoint(path, storage_options)
    there = os.path.isdir(os.fspath(path)) if not store.remote else name in store.list_committed()
    if not there:
        raise NoCheckpointError(f"no checkpoint at {path}")
    return read_checkpoint(store, name, rank)


def read_run(location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
             tag: str | None = None) -> LoadedCheckpoint:
    """The newest checkpoint of the run at ``location`` that verifies (with ``tag``: the newest
    carrying it), read-only: invalid ones are skipped with a warning, nothing is moved, no lock
    is taken, so a job that only reads can run beside the training that writes. If the training
    prunes the checkpoint being read, the run is listed again (a newer one has committed: retention
    never deletes the newest), rather than falling back to older ones that are being pruned too."""
    from .checkpoint.discovery import newest_valid, tagged  # discovery builds on this module

    store = open_store(location, storage_options, readonly=True)
    bad: set[str] = set()

    class Pruned(Exception):
        pass

    def skip(name: str, reason: str) -> None:
        if vanished(store, name):
            raise Pruned(name)
        bad.add(name)
        log.warning("skipping an invalid checkpoint: %s", reason)

    for _attempt in range(RELISTS):
        names = tagged(store, tag) if tag is not None else None
        try:
            def wanted(n: str, names: set[str] | None = names) -> bool:
                return n not in bad and (names is None or n in names)

            loaded, _ = newest_valid(store, skip, wanted)
            break
        except Pruned as e:
            log.info("%s was pruned while it was read; looking for the newest checkpoint again", store.describe(str(e)))
    else:
        raise UnbrokenError(f"the checkpoints of {location} were pruned {RELISTS} times while being read: the "
                            "training that writes the run deletes them faster than they can be read; keep more "
                            "(keep_last) or tag the one to read")
    if loaded is None:
        what = f"tagged {tag!r} " if tag is not None else ""
        raise NoCheckpointError(f"no valid checkpoint {what}in {location}"
                                + (f" ({len(bad)} failed verification)" if bad else ""))
    return loaded


def verify(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """Fully verify a checkpoint: every file of every rank (size, checksum), the tensor headers
    and the state trees; raise :class:`CorruptCheckpointError` if anything is wrong, or its
    subclass :class:`~unbroken.errors.CheckpointVanishedError` if the checkpoint was deleted while
    it was read (pruned by a training process writing the run: not damaged)."""
    store, name = split_checkpoint(path, storage_options)
    read_path(path, storage_options)  # NoCheckpointError, and rank 0's part decoded
    loaded = verify_all(store, name)
    return CheckpointInfo.of(str(path), loaded.name, loaded.manifest)


def load(path: str | os.PathLike[str], state: MutableMapping[str, Any] | None = None, *,
         strict: bool = True, storage_options: Mapping[str, Any] | None = None,
         tag: str | None = None) -> dict[str, Any]:
    """Verify and load a checkpoint, or the newest valid checkpoint of a run (a folder or a URL).

    ``path`` may be one checkpoint, or a run written by a :class:`Checkpointer`: then the
    newest checkpoint that verifies is loaded (with ``tag``, the newest carrying that tag);
    invalid ones are skipped with a warning. This is the read-only restore for evaluation
    jobs and notebooks: nothing is moved, quarantined or locked, so it works beside the
    training process that writes the run, and no RNG or progress counter is touched.

    With ``state``, restore into its objects in place (``load_state_dict`` for
    ``Stateful`` objects) and return it; like a restore, every key, shape, dtype and the
    class of each optimizer and scheduler are checked before anything is loaded. Without,
    return the saved tree as plain Python values and CPU tensors. Never unpickles anything.
    A checkpoint written by a :class:`Checkpointer` loads into a plain ``state``: its own part
    (``__unbroken__``: progress, RNGs) is left out unless ``state`` has that key.
    """
    if tag is None and not is_run(path, storage_options):
        loaded = read_path(path, storage_options)
    else:
        loaded = read_run(path, storage_options, tag)
    tree = loaded.materialize()  # sharded tensors (saved by several ranks) as full tensors
    if state is None:
        return unwrap(tree)
    if RESERVED not in state:  # a Checkpointer's own part (progress, RNGs): not the user's state
        tree = {k: v for k, v in tree.items() if k != RESERVED}
    apply_state(adapt(state), tree, strict=strict)
    return dict(state)


def unwrap(x: Any) -> Any:
    """Replace saved ``Stateful`` markers by their plain state dicts, recursively."""
    if isinstance(x, StatefulValue):
        return unwrap(x.value)
    if isinstance(x, dict):
        for k in list(x):
            x[k] = unwrap(x[k])
        return x
    if isinstance(x, list):
        return [unwrap(v) for v in x]
    return x
