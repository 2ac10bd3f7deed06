"""The recorder inside the script's process, installed by a Checkpointer in selftest mode.

Per optimizer step (in ``ckpt.step``, before any save, so both runs fingerprint the same
instant) it appends one JSON line to ``records.jsonl``: the step, the process (segment),
and the components of :mod:`.fingerprint` plus what only hooks can see:

- ``gradients``: the ``.grad`` of every parameter right before each ``optimizer.step()``
  (a global optimizer step pre-hook);
- ``batch/indices``, ``batch/data``: the sample indices and the contents of the batches the
  loop received since the previous step (a wrapper around DataLoader iterators: every
  ``torch.utils.data.DataLoader``, the one inside ``ResumableLoader`` included);
- ``batch/rng/*``: the global RNG streams right before the first batch of the step (so a
  draw between ``restore()`` and the first forward shows there);
- ``unsaved generators``: random generators the script holds outside the state (found in the
  calling frames), whose restarting from their seed explains a divergence after a resume.

Right after ``restore()`` it writes a ``restore`` record (the state as restored). Then it
carries out the interruption the selftest asked for (:mod:`.protocol`). Under torchrun every
rank records to its own file (:func:`.protocol.records_file`) and only rank 0 interrupts itself. Nothing here draws
from a random generator. None of this is imported outside selftest mode.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import dataloader as _dl

from ..data.loader import ResumableLoader
from ..events import Event, Restored, Saved, Started
from . import protocol
from .fingerprint import digest, generator_state, rng_streams, state_components

_PACKAGE = str(Path(__file__).resolve().parent.parent)
_active: "Hooks | None" = None  # the recorder the process-wide hooks report to


def _next_index(self: Any) -> Any:
    index = _ORIG_NEXT_INDEX(self)
    self.__dict__.setdefault("_unbroken_pending", collections.deque()).append(index)
    return index


def _next(self: Any) -> Any:
    hooks = _active
    if hooks is not None and hooks.batch_rng is None:
        hooks.batch_rng = {f"batch/{k}": v for k, v in rng_streams().items()}
    batch = _ORIG_NEXT(self)
    pending = self.__dict__.get("_unbroken_pending")
    if hooks is not None:
        hooks.batches.append((pending.popleft() if pending else None, digest(batch)))
    return batch


_ORIG_NEXT_INDEX = _dl._BaseDataLoaderIter._next_index
_ORIG_NEXT = _dl._BaseDataLoaderIter.__next__


def _install_process_hooks() -> None:
    if getattr(_dl._BaseDataLoaderIter, "_unbroken_selftest", False):
        return
    _dl._BaseDataLoaderIter._next_index = _next_index  # type: ignore[method-assign]
    _dl._BaseDataLoaderIter.__next__ = _next  # type: ignore[method-assign]
    _dl._BaseDataLoaderIter._unbroken_selftest = True  # type: ignore[attr-defined]
    register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _active is not None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        _active.grads.append((id(optimizer), digest(grads)))


class Hooks:
    """Records the fingerprints of one process of a selftest run and carries out its interruption."""

    def __init__(self, ckpt: Any) -> None:
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
        self.batches: list[tuple[Any, str]] = []
        self.grads: list[tuple[int, str]] = []
        self.batch_rng: dict[str, str] | None = None
        self._fd: int | None = None
        _active = self
        _install_process_hooks()
        self.write({"kind": "hello", "pid": os.getpid()})
        ckpt.events.subscribe(self)

    # --------------------------------------------------------------- writing
    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.dir / protocol.records_file(self.rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = json.dumps({"seg": self.segment, **record}, sort_keys=True) + "\n"
        os.write(self._fd, line.encode())  # one write per record: a SIGKILL never leaves half a line in the middle

    def _fresh(self) -> None:
        self.batches, self.grads, self.batch_rng = [], [], None

    # --------------------------------------------------------------- restore
    def watch(self, state: Mapping[str, Any]) -> None:
        """``restore(state)`` was called: the ``Restored``/``Started`` event that ends it is recorded."""
        self.state = state

    def on_event(self, e: Event) -> None:
        if isinstance(e, (Restored, Started)) and self.state is not None:
            step = e.step
            self.resumed_from = step if isinstance(e, Restored) else None
            self.write({"kind": "restore", "step": step, "resumed_from": self.resumed_from,
                        "c": self.components(self.state, step)})
            self._fresh()
        elif isinstance(e, Saved):
            self.write({"kind": "saved", "step": e.manifest.step, "name": e.name})

    # ------------------------------------------------------------------ step
    def components(self, state: Mapping[str, Any], step: int) -> dict[str, str]:
        out = state_components(state)
        out.update(rng_streams())
        out["unsaved generators"] = self.unsaved_generators(state)
        return out

    def step_ended(self, ckpt: Any, state: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """In ``ckpt.step``, after the step's bookkeeping and before any save: one record."""
        step = ckpt.progress.step
        c = self.components(state, step)
        names = {id(v): k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        per_opt: dict[str, list[str]] = {}
        for oid, h in self.grads:
            per_opt.setdefault(names.get(oid, "optimizer outside the state"), []).append(h)
        for name, hs in per_opt.items():
            c[f"{name}/gradients"] = digest(hs)
        if self.batches:
            indices = [i for i, _ in self.batches]
            if any(i is not None for i in indices):
                c["batch/indices"] = digest([[int(x) for x in i] if isinstance(i, list) else repr(i)
                                             for i in indices])
            c["batch/data"] = digest([h for _, h in self.batches])
        c.update(self.batch_rng or {})
        for k, v in metrics.items():
            c[f"metric/{k}"] = digest(v)
        c["progress"] = json.dumps(ckpt.progress.state_dict(), sort_keys=True)
        self.write({"kind": "step", "step": step, "resumed_from": self.resumed_from, "c": c})
        self._fresh()
        if self.kill == "sigterm" and step >= self.kill_at:
            self.kill = ""
            self.write({"kind": "injected", "what": "sigterm", "step": step})
            os.kill(os.getpid(), signal.SIGTERM)  # the preemption handler runs now: this step saves and exits 75

    def after_step(self, ckpt: Any) -> None:
        """At the end of ``ckpt.step`` (after a save): the planned interruption or the planned stop."""
        step = ckpt.progress.step
        if self.kill in ("sigkill", "exception") and step >= self.kill_at:
            what, self.kill = self.kill, ""
            self.write({"kind": "injected", "what": what, "step": step})
            if what == "sigkill":
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"{protocol.INJECTED} after step {step}")
        if self.stop and step >= self.stop:
            self.write({"kind": "stopped", "step": step})
            raise SystemExit(0)

    # ----------------------------------------------------------- evidence
    def unsaved_generators(self, state: Mapping[str, Any]) -> str:
        """One digest over the states of the random generators the script holds outside the state:
        in the locals and globals of the calling frames (outside unbroken), one attribute deep."""
        managed = {id(torch.default_generator), id(np.random.mtrand._rand), id(random._inst)}  # type: ignore[attr-defined]
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

        frame = sys._getframe(1)
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
