"""The recorder inside the script's process, installed by a Checkpointer in selftest mode.

Per optimizer step (in ``ckpt.step``, before any save, so both runs fingerprint the same
instant) it appends one JSON line to ``records.jsonl``: the step, the process (segment), the
components of :mod:`.fingerprint` (compared between the runs, ``c``) and evidence (``e``, read
only to explain a difference). What only hooks can see:

- ``gradients``: the ``.grad`` of every parameter right before each ``optimizer.step()``
  (a global optimizer step pre-hook);
- the *training* batches: every ``torch.utils.data.DataLoader`` iterator is wrapped (the one
  inside ``ResumableLoader`` included), and a DataLoader is the training one when it served the
  last batch (fetched with gradients enabled, if any was) before an ``optimizer.step()``.
  ``batch/indices`` and ``batch/data`` are the sample indices and contents of its batches of the
  step; ``batch/rng/*`` the global RNG streams right before its first batch of the step (what
  the step consumes: an evaluation between two steps draws before that, and is not in it).
  Batches of other DataLoaders (an evaluation) are evidence (``e.side``), as is a training
  iterator running out (``e.epoch_end``: an epoch ended since the previous step);
- ``e.v``: the plain variables of the loop's frame at the first training batch of the step
  (:mod:`.variables`), which name a value carried from step to step outside the state;
- ``unsaved generators``: random generators the script holds outside the state (found in the
  calling frames), whose restarting from their seed explains a divergence after a resume.

Right after ``restore()`` it writes a ``restore`` record (the state as restored, and the
variables of the frame that called ``restore()``). Then it carries out the interruption the
selftest asked for (:mod:`.protocol`), including ``between``: a SIGKILL when a DataLoader other
than the training one serves its first batch after the given step (inside an evaluation). In the
uninterrupted run it also records which lines of the script ran (:mod:`.lines`). Under torchrun
every rank records to its own file (:func:`.protocol.records_file`) and only rank 0 interrupts
itself. Nothing here draws from a random generator. None of this is imported outside selftest mode.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import os
import random
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import dataloader as _dl

from ..data.loader import ResumableLoader
from ..events import Event, Restored, Saved, Started
from . import protocol
from .fingerprint import digest, generator_state, rng_streams, state_components
from .lines import Lines
from .variables import caller, loop_frame, read_before_set, snapshot, where

if TYPE_CHECKING:
    from ..faults.host import Host

_PACKAGE = str(Path(__file__).resolve().parent.parent)
_active: Hooks | None = None  # the recorder the process-wide hooks report to
_serial = itertools.count(1)  # orders iterator creations and restores in this process


def _init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
    _ORIG_INIT(self, loader, *args, **kwargs)
    self._unbroken_born = next(_serial)
    self._unbroken_loader = id(loader)


def _next_index(self: Any) -> Any:
    index = _ORIG_NEXT_INDEX(self)
    self.__dict__.setdefault("_unbroken_pending", collections.deque()).append(index)
    return index


def _next(self: Any) -> Any:
    hooks = _active
    if hooks is None:
        return _ORIG_NEXT(self)
    with hooks.untraced():
        start = hooks.before_batch(self)
    try:
        batch = _ORIG_NEXT(self)
    except StopIteration:
        hooks.ran_out(self)
        raise
    pending = self.__dict__.get("_unbroken_pending")
    with hooks.untraced():
        hooks.got_batch(self, start, pending.popleft() if pending else None, digest(batch))
    return batch


_ORIG_INIT = _dl._BaseDataLoaderIter.__init__
_ORIG_NEXT_INDEX = _dl._BaseDataLoaderIter._next_index
_ORIG_NEXT = _dl._BaseDataLoaderIter.__next__


def _install_process_hooks() -> None:
    if getattr(_dl._BaseDataLoaderIter, "_unbroken_selftest", False):
        return
    _dl._BaseDataLoaderIter.__init__ = _init  # type: ignore[method-assign]
    _dl._BaseDataLoaderIter._next_index = _next_index  # type: ignore[method-assign]
    _dl._BaseDataLoaderIter.__next__ = _next  # type: ignore[method-assign]
    _dl._BaseDataLoaderIter._unbroken_selftest = True  # type: ignore[attr-defined]
    register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _active is not None:
        with _active.untraced():
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
            _active.grads.append((id(optimizer), digest(grads)))
            _active.optimizer_step()


def _loader_of(it: Any) -> int:
    """The DataLoader an iterator belongs to (the iterator itself if it predates the hooks)."""
    return it.__dict__.get("_unbroken_loader", id(it))


class Hooks:
    """Records the fingerprints of one process of a selftest run and carries out its interruption."""

    def __init__(self, ckpt: Host) -> None:
        global _active
        self.dir = Path(os.environ[protocol.DIR])
        self.segment = int(os.environ.get(protocol.SEGMENT, "0") or 0)
        self.stop = int(os.environ.get(protocol.STOP, "0") or 0)
        kind, _, at = os.environ.get(protocol.KILL, "").partition("@")
        self.rank = int(os.environ.get("RANK", "0") or 0)
        # only rank 0 interrupts itself: torchrun tears the other ranks down after a SIGKILL or an
        # exception, and after a SIGTERM unbroken's preemption flag stops every rank at the same step
        self.kill, self.kill_at = (kind, int(at or 0)) if self.rank == 0 else ("", 0)
        self.state: Mapping[str, Any] | None = None
        self.resumed_from: int | None = None
        self.step = 0  # the last step recorded
        self.restored_at = 0  # serial of the last restore
        self.step_serial = 0  # serial of the last step's end
        self.loop: Any = None  # the code that calls ckpt.step() (or restore() until the first step)
        self.loop_line: tuple[str, int] | None = None
        self.train_loaders: set[int] = set()  # DataLoaders that served a batch right before optimizer.step()
        self.epoch: int | None = None  # progress.epoch at the last step recorded (an epoch ended when it moves)
        self.grads: list[tuple[int, str]] = []
        self._fresh()
        self._fd: int | None = None
        self.lines = Lines() if os.environ.get(protocol.LINES) and self.rank == 0 else None
        if self.lines is not None:
            self.lines.start(caller(2))
            atexit.register(self._write_lines)
        _active = self
        _install_process_hooks()
        self.write({"kind": "hello", "pid": os.getpid()})
        ckpt.events.subscribe(self)

    @contextlib.contextmanager
    def untraced(self) -> Iterator[None]:
        """The recorder's own work is not the script's: line tracing (the uninterrupted run) pauses."""
        paused = self.lines.pause() if self.lines is not None else False
        try:
            yield
        finally:
            if self.lines is not None:
                self.lines.resume(paused)

    # --------------------------------------------------------------- writing
    def write(self, record: dict[str, Any]) -> None:
        """Append one record (one JSON line) to this rank's records file."""
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.dir / protocol.records_file(self.rank),
                               os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = json.dumps({"seg": self.segment, **record}, sort_keys=True) + "\n"
        os.write(self._fd, line.encode())  # one write per record: a SIGKILL never leaves half a line in the middle

    def _fresh(self) -> None:
        self.grads = []
        self.batches: list[tuple[int, Any, str]] = []  # (loader, sample indices, digest)
        self.starts: dict[int, dict[str, Any]] = {}  # loader -> what its first batch of the step saw
        self.last: tuple[int, bool] | None = None  # (loader, gradients enabled) of the last batch
        self.last_grad: int | None = None  # loader of the last batch fetched with gradients enabled
        self.trained: set[int] = set()  # loaders that served the last batch before an optimizer step
        self.ran_out_loaders: list[int] = []

    # --------------------------------------------------------------- batches
    def before_batch(self, it: Any) -> dict[str, Any] | None:
        """Before an iterator fetches: the planned ``between`` kill; the global RNG streams and the loop's
        variables, if this would be its DataLoader's first batch of the step."""
        loader = _loader_of(it)
        if (self.kill == "between" and self.step >= self.kill_at and self.train_loaders
                and loader not in self.train_loaders):
            self.kill = ""
            self.write({"kind": "injected", "what": "between", "step": self.step})
            self._sigkill()
        if loader in self.starts:
            return None
        frame = loop_frame(sys._getframe(2), self.loop)
        start: dict[str, Any] = {"rng": {f"batch/{k}": v for k, v in rng_streams().items()},
                                 "born": it.__dict__.get("_unbroken_born", 0)}
        if frame is not None:
            start["v"], start["vf"] = snapshot(frame.f_locals, self._skip()), where(frame)
        return start

    def got_batch(self, it: Any, start: dict[str, Any] | None, index: Any, h: str) -> None:
        """An iterator served a batch (``index``: its sample indices, ``h``: its digest)."""
        loader = _loader_of(it)
        if start is not None and loader not in self.starts:
            try:
                start["len"] = len(it)
            except TypeError:
                pass
            self.starts[loader] = start
        self.batches.append((loader, index, h))
        self.last = (loader, torch.is_grad_enabled())
        if self.last[1]:
            self.last_grad = loader

    def ran_out(self, it: Any) -> None:
        self.ran_out_loaders.append(_loader_of(it))

    def optimizer_step(self) -> None:
        """An ``optimizer.step()``: the DataLoader of the last batch before it is a training one."""
        loader = self.last_grad if self.last_grad is not None else (self.last[0] if self.last else None)
        if loader is not None:
            self.trained.add(loader)

    def _skip(self) -> set[int]:
        """Objects the variables' snapshot leaves out: the state's own (compared as components)."""
        state = self.state or {}
        return {id(state)} | {id(v) for v in state.values()}

    # --------------------------------------------------------------- restore
    def watch(self, state: Mapping[str, Any]) -> None:
        """``restore(state)`` was called: the ``Restored``/``Started`` event that ends it is recorded."""
        self.state = state
        frame = caller(1)
        if frame is not None:
            self.loop = frame.f_code
            self._restore_vars = (snapshot(frame.f_locals, self._skip()), where(frame))

    def on_event(self, e: Event) -> None:
        """A Checkpointer event: a ``restore`` record after a restore, a ``saved`` record after a save."""
        with self.untraced():
            self._on_event(e)

    def _on_event(self, e: Event) -> None:
        if isinstance(e, (Restored, Started)) and self.state is not None:
            step = e.step
            self.resumed_from = step if isinstance(e, Restored) else None
            self.step, self.restored_at = step, next(_serial)
            v, vf = getattr(self, "_restore_vars", ({}, ""))
            self.write({"kind": "restore", "step": step, "resumed_from": self.resumed_from,
                        "c": self.components(self.state, step), "e": {"v": v, "vf": vf}})
            self._fresh()
        elif isinstance(e, Saved):
            self.write({"kind": "saved", "step": e.manifest.step, "name": e.name})

    # ------------------------------------------------------------------ step
    def components(self, state: Mapping[str, Any], step: int) -> dict[str, str]:
        out = state_components(state)
        out.update(rng_streams())
        out["unsaved generators"] = self.unsaved_generators(state)
        return out

    def step_ended(self, ckpt: Host, state: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """In ``ckpt.step``, after the step's bookkeeping and before any save: one record."""
        with self.untraced():
            self._record(ckpt, state, metrics)
        if self.kill == "sigterm" and self.step >= self.kill_at:
            self.kill = ""
            self.write({"kind": "injected", "what": "sigterm", "step": self.step})
            os.kill(os.getpid(), signal.SIGTERM)  # the preemption handler runs now: this step saves and exits 75

    def _record(self, ckpt: Host, state: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        step = self.step = ckpt.progress.step
        frame = caller(1)
        if frame is not None:
            self.loop, self.loop_line = frame.f_code, (frame.f_code.co_filename, frame.f_lineno)
        c = self.components(state, step)
        names = {id(v): k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        per_opt: dict[str, list[str]] = {}
        for oid, h in self.grads:
            per_opt.setdefault(names.get(oid, "optimizer outside the state"), []).append(h)
        for name, hs in per_opt.items():
            c[f"{name}/gradients"] = digest(hs)
        if not self.trained and self.last is not None:  # no optimizer.step() seen: the last batch's loader
            self.trained.add(self.last_grad if self.last_grad is not None else self.last[0])
        e = self._batches(c)
        epoch = ckpt.progress.epoch  # moved on by a ResumableLoader, ckpt.batches(), end_epoch, the integrations
        if self.epoch is not None and epoch > self.epoch:
            e["epoch_end"] = True
        self.epoch = epoch
        if "v" not in e and frame is not None:  # no training batch: the variables at the step's end, and what
            e["v_end"], e["vf_end"] = snapshot(frame.f_locals, self._skip()), where(frame)  # the loop reads first
            e["reads"] = read_before_set(*self.loop_line) if self.loop_line else ()
        for k, v in metrics.items():
            c[f"metric/{k}"] = _metric(v)
        c["progress"] = json.dumps(ckpt.progress.state_dict(), sort_keys=True)
        self.write({"kind": "step", "step": step, "resumed_from": self.resumed_from, "c": c, "e": e})
        self.train_loaders |= self.trained
        self.step_serial = next(_serial)
        self._fresh()

    def _batches(self, c: dict[str, str]) -> dict[str, Any]:
        """The training batches' components into ``c``; the evidence about the batches returned."""
        train = [(i, h) for loader, i, h in self.batches if loader in self.trained]
        side = [h for loader, _, h in self.batches if loader not in self.trained]
        e: dict[str, Any] = {"side": len(side), "batches": len(train),
                             "epoch_end": any(x in self.train_loaders | self.trained for x in self.ran_out_loaders)}
        if side:
            e["side_data"] = digest(side)
        if train:
            indices = [i for i, _ in train]
            if any(i is not None for i in indices):
                c["batch/indices"] = digest([[int(x) for x in i] if isinstance(i, list) else repr(i)
                                             for i in indices])
            c["batch/data"] = digest([h for _, h in train])
        first = next((loader for loader, _, _ in self.batches if loader in self.trained), None)
        start = self.starts.get(first) if first is not None else None
        if start is not None:
            c.update(start["rng"])
            born = start["born"]
            e["iterator"] = ("before restore" if born < self.restored_at else
                             "this step" if born > self.step_serial else "earlier")
            if "len" in start:
                e["epoch_len"] = start["len"]
            if "v" in start:
                e["v"], e["vf"] = start["v"], start["vf"]
        return e

    def after_step(self, ckpt: Host) -> None:
        """At the end of ``ckpt.step`` (after a save): the planned interruption or the planned stop."""
        step = ckpt.progress.step
        if self.kill in ("sigkill", "exception") and step >= self.kill_at:
            what, self.kill = self.kill, ""
            self.write({"kind": "injected", "what": what, "step": step})
            if what == "sigkill":
                self._sigkill()
            raise RuntimeError(f"{protocol.INJECTED} after step {step}")
        if self.stop and step >= self.stop:
            self._write_lines()
            self.write({"kind": "stopped", "step": step})
            raise SystemExit(0)

    def _sigkill(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _write_lines(self) -> None:
        if self.lines is not None:
            lines, self.lines = self.lines, None
            lines.stop()
            self.write({"kind": "lines", "steps": self.step, **lines.report(self.loop_line)})

    # ----------------------------------------------------------- evidence
    def unsaved_generators(self, state: Mapping[str, Any]) -> str:
        """One digest over the states of the random generators the script holds outside the state:
        in the locals and globals of the calling frames (outside unbroken), one attribute deep."""
        managed = {id(torch.default_generator), id(np.random.mtrand._rand), id(random._inst)}
        for v in state.values():
            managed.add(id(v))
            if isinstance(v, ResumableLoader):
                managed.add(id(v._generator))  # reseeded from the data position by design
            elif isinstance(v, Mapping):
                managed.update(id(x) for x in v.values())
        found: dict[int, str] = {}

        def look(x: Any) -> None:
            if id(x) in managed or id(x) in found:
                return
            h = generator_state(x)
            if h is not None:
                found[id(x)] = h

        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if not frame.f_code.co_filename.startswith(_PACKAGE):
                scopes = [frame.f_locals] + ([frame.f_globals] if frame.f_globals.get("__name__") == "__main__" else [])
                for scope in scopes:
                    for x in list(scope.values()):
                        look(x)
                        attrs = getattr(x, "__dict__", None)
                        if isinstance(attrs, dict) and not isinstance(x, type) and type(x).__name__ != "module":
                            for y in list(attrs.values()):
                                look(y)
            frame = frame.f_back
        return digest(sorted(found.values()))


def _metric(v: Any) -> str:
    """A metric passed to ``ckpt.step``: a scalar as its exact value (readable in a report), else its digest."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, (float, int)) and not isinstance(v, bool):
        return repr(v)
    return digest(v)
