"""Lazy snapshots: what only ``optimizer.step()`` changes is copied while the next
forward/backward runs (``Checkpointer(..., async_save="lazy")``).

Parameters and optimizer state do not change between one optimizer step and the next:
forward and backward read them and write gradients and buffers elsewhere. So at the save
point only the rest of the state is copied (buffers such as BatchNorm statistics, which
forward changes, gradients, RNG states, the data position, progress, every non-tensor
value). The tensors of every :class:`torch.optim.Optimizer` in the state (its parameters
and its per-parameter state) are copied by the background writer, and a global optimizer
step pre-hook holds the *next* ``optimizer.step()`` of any optimizer until those copies
are made. The loop blocks at the save point only for the eager part, and at the next step
only if the copy has not finished by then.

**Nothing inexact gets through.** Every deferred tensor's version counter (bumped by every
in-place change, in any grad mode) is recorded at the save point and compared when the
training thread next reaches an optimizer step, a save, :meth:`~unbroken.Checkpointer.flush`
or ``close()``. A tensor changed in between (an EMA written into the optimized weights by
hand, ``load_state_dict`` on the model, a parameter clamped outside the optimizer) makes the
save fail with :class:`~unbroken.errors.UnbrokenError` naming it, raised in the loop like any
background failure; the checkpoint is not committed. The verdict does not depend on timing.

Only tensors held by a ``torch.optim.Optimizer`` are deferred: optimizers that are not
subclasses of it have no step hooks, so their tensors are copied eagerly, and so are
parameters that no optimizer in the state updates.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...errors import UnbrokenError
from ...state.walk import instances
from ..snapshot import Snapshot, storage_key


def step_only_storages(state: Mapping[str, Any]) -> frozenset[tuple[str, int]]:
    """The memory of every tensor that only an optimizer step changes: the parameters and
    the per-parameter state of every ``torch.optim.Optimizer`` found in ``state`` (values,
    dicts and lists of them)."""
    keys: set[tuple[str, int]] = set()
    for opt in instances(state, torch.optim.Optimizer):
        for group in opt.param_groups:
            keys.update(storage_key(p) for p in group["params"] if p.numel())
        for s in opt.state.values():
            keys.update(storage_key(t) for t in instances(s, torch.Tensor) if t.numel())
    return frozenset(keys)


class StepGate:
    """Holds the next ``optimizer.step()`` until the deferred copies of ``snaps`` are made,
    and judges (in the training thread) whether a deferred tensor changed meanwhile.

    The background writer calls :meth:`copy` (the copies), then :meth:`verdict`, which waits
    for the training thread's judgement; the training thread judges at the next optimizer
    step (the hook), or in :meth:`judge`, which the Checkpointer calls before it waits for
    the save. Once the main thread has ended (interpreter exit) the writer judges itself.
    """

    def __init__(self, snaps: list[Snapshot]) -> None:
        self._snaps = snaps
        live = [(t, key) for s in snaps for _, t, key in s.deferred] + [x for s in snaps for x in s.device_deferred]
        self._watched = [(t, t._version, key.split(":", 1)[-1]) for t, key in live]
        self._lazy_events = [ev for s in snaps for ev in s.lazy_events]
        self._copied = threading.Event()
        self._judged = threading.Event()
        self._error: UnbrokenError | None = None
        self._lock = threading.Lock()
        self._handle = register_optimizer_step_pre_hook(self._before_step)

    @property
    def pending(self) -> int:
        return len(self._watched)

    def copy(self) -> None:
        """In the writer: make the deferred copies (then the optimizer step may go on)."""
        try:
            for s in self._snaps:
                s.complete()
        finally:
            self._copied.set()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.judge()

    def judge(self) -> None:
        """In the training thread: wait for the copies and record whether anything deferred
        changed since the save point. Idempotent; cheap once judged."""
        if self._judged.is_set():
            return
        self._copied.wait()
        with self._lock:
            if self._judged.is_set():
                return
            for ev in self._lazy_events:  # the GPU's next step waits for the copies, not the CPU
                torch.cuda.current_stream(ev.device if hasattr(ev, "device") else None).wait_event(ev)
            changed = [key for t, version, key in self._watched if t._version != version]
            if changed:
                self._error = UnbrokenError(
                    f"{len(changed)} tensor(s) held by the optimizer changed between the save point and "
                    f"the next optimizer step, e.g. {', '.join(changed[:3])}: a lazy snapshot copies them "
                    "in that window, so this checkpoint could be torn and was not committed. Change them "
                    "only in optimizer.step(), or use async_save=True (which copies everything at once)")
            self._judged.set()

    def verdict(self) -> None:
        """In the writer: wait for the judgement; raise if the snapshot is not exact."""
        while not self._judged.wait(0.2):
            if not threading.main_thread().is_alive():  # interpreter exit: no more training
                self.judge()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Remove the step hook (in the training thread, once the save is collected)."""
        self._handle.remove()
