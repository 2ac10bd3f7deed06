r"""Exact emergency checkpoints when a step raises (``Checkpointer.guard``).

At the start of every step (on entering the guard, and after each
``Checkpointer.step``) the guard keeps what a step changes *before* the optimizer
steps: the global RNG states, the loop progress, module buffers (BatchNorm running
statistics change in the forward pass) and the state of every light ``Stateful``
object in the state (data loaders, samplers, user objects). It also hooks every
optimizer in the state to learn whether it stepped.

When the step raises:

- **the optimizer has not stepped** (an OOM in forward or backward, a bad batch): the
  parameters, optimizer and scheduler are still as they were at the start of the step,
  so the checkpoint is written from them plus the kept RNG, progress, buffers and light
  state — exactly the state at the start of the failed step. Resuming re-runs that step
  from the same batch with the same dropout masks.
- **the optimizer has stepped**: the step's update is kept and the checkpoint is the
  state *after* the step (progress advanced by one), once the step's bookkeeping is done.
- **the state is torn** — the optimizer raised half-way through its update, or it stepped
  but the bookkeeping did not finish (a ``GradScaler`` stepped but not ``update()``\ d, an
  LR scheduler that advances every step but has not this time): no emergency checkpoint,
  because none could describe one instant; the previous committed checkpoint stays the
  newest and the resume re-runs from there, exactly.

An exception inside ``Checkpointer.step`` (a failing save, a full disk) comes after the
step boundary was marked, so it is "not stepped" with the start being the state after
the step: the emergency checkpoint is exactly what the failed save would have written.

Then the exception propagates unchanged.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any, Callable

import torch

from ..state.rng import GlobalRNG
from ..state.stateful import Gradients, is_stateful

log = logging.getLogger("unbroken")
_HEAVY = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
          torch.optim.lr_scheduler.ReduceLROnPlateau, torch.amp.GradScaler, Gradients)


def _copy_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return copy.deepcopy(x)


class StepStart:
    """What the state looked like when the current step began (see module docstring)."""

    def __init__(self, state: Mapping[str, Any], progress: dict[str, int]) -> None:
        self.progress = dict(progress)
        self.rng = GlobalRNG().state_dict()  # get_state() calls already return copies
        self.schedulers = {key: obj.last_epoch for key, obj in state.items()
                           if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)}
        self.light: dict[str, Any] = {}
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        for key, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                params = {name for name, _ in obj.named_parameters()}
                self.buffers[key] = {name: t.detach().clone() for name, t in obj.state_dict().items()
                                     if name not in params}
            elif is_stateful(obj) and not isinstance(obj, _HEAVY):
                self.light[key] = _copy_tree(obj.state_dict())

    def rebuild(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The state as of this step's start, built from live objects plus what was kept."""
        out: dict[str, Any] = dict(state)
        for key, saved in self.light.items():
            out[key] = saved
        for key, buffers in self.buffers.items():
            sd = state[key].state_dict()
            sd.update(buffers)
            out[key] = sd
        for key, obj in state.items():
            if isinstance(obj, Gradients):
                out[key] = {name: None for name, _ in obj.module.named_parameters()}
        return out


class StepGuard:
    """Context manager returned by :meth:`unbroken.Checkpointer.guard`.

    ``attach(guard_or_None)`` tells the Checkpointer which guard to :meth:`mark` at each
    step boundary; ``on_error(guard, exc)`` writes the emergency checkpoint.
    """

    def __init__(self, state: Mapping[str, Any], progress: Any, attach: Callable[[Any], None],
                 on_error: Callable[["StepGuard", BaseException | None], Any]) -> None:
        self.state = state
        self.progress = progress
        self.attach, self.on_error = attach, on_error
        self.stepped = False
        self.stepping = False
        self.start: StepStart | None = None
        self.per_step: set[str] = set()
        self._hooks: list[Any] = []

    def prepare(self, progress: dict[str, int]) -> StepStart:
        """What the next step's start looks like, with ``progress`` as its counters: computed
        before anything changes, so that marking the boundary cannot fail half-way."""
        return StepStart(self.state, progress)

    def mark(self, start: StepStart | None = None) -> None:
        """A new step begins now (``start``: from :meth:`prepare`)."""
        previous = self.start
        self.start = start if start is not None else StepStart(self.state, self.progress.state_dict())
        if previous is not None:  # learn which schedulers advance every step
            self.per_step = {k for k, v in self.start.schedulers.items() if previous.schedulers.get(k) != v}
        self.stepped = self.stepping = False

    def torn(self) -> str | None:
        """Why the live state is not one instant, if it is not: an optimizer step that raised
        half-way (some parameters updated), or a step whose bookkeeping did not finish."""
        if self.stepping and not self.stepped:
            return "the optimizer was stepping (some parameters may be updated, others not)"
        if not self.stepped or self.start is None:
            return None
        for key, obj in self.state.items():
            if isinstance(obj, torch.amp.GradScaler) and any(
                    st.get("stage") is not None and st["stage"].name != "READY"
                    for st in getattr(obj, "_per_optimizer_states", {}).values()):
                return f"state[{key!r}] (GradScaler) stepped the optimizer but update() was not called"
            if key in self.per_step and obj.last_epoch == self.start.schedulers.get(key):
                return f"state[{key!r}] (an LR scheduler stepped every step) has not stepped yet"
        return None

    def _on_optimizer_pre_step(self, optimizer: Any, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The update begins, unless ``step`` got a closure (Lightning, LBFGS): the closure runs the
        forward and backward pass *inside* ``step`` and changes no parameter, so the update begins
        only once it returns; an exception in it leaves the step cleanly not begun."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is None:
            self.stepping = True
            return None

        def closure_then_update() -> Any:
            result = closure()
            self.stepping = True
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_update}
        return (args[0], closure_then_update, *args[2:]), kwargs

    def _on_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self.stepped = True
        self.stepping = False

    def __enter__(self) -> "StepGuard":
        for obj in self.state.values():
            if isinstance(obj, torch.optim.Optimizer):
                self._hooks.append(obj.register_step_pre_hook(self._on_optimizer_pre_step))
                self._hooks.append(obj.register_step_post_hook(self._on_optimizer_step))
        self.mark()
        self.attach(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.attach(None)
        if exc_type is None or issubclass(exc_type, (SystemExit, GeneratorExit)):
            return False
        try:
            self.on_error(self, exc)  # may end the process as a preemption (SystemExit 75)
        except Exception as err:  # never hide the original exception
            log.error("emergency checkpoint failed: %s: %s", type(err).__name__, err)
        return False
