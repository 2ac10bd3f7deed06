r"""Exact emergency checkpoints when a step raises (``Checkpointer.guard``).

An emergency checkpoint is exact or it is not written. It can describe one of two instants:
the **start** of the failed step (the state :meth:`Checkpointer.step` left behind) or its
**end** (the state the next ``ckpt.step()`` would have marked). When a step raises, the guard
decides from evidence it took at the step's start — never from what it learned in earlier
steps, so the first step of a process (a fresh start, or the first after a resume) is judged
like any other — which instant the live state can be turned into, or that it cannot:

- **No optimizer stepped** (an OOM in forward or backward, a bad batch, a step skipped by
  ``GradScaler`` on inf/nan or by the loop on a bad loss): the checkpoint of the step's start.
  What a step may move before or instead of the optimizer step is kept at the start and put
  back: the global RNG states, the loop progress, module buffers (BatchNorm statistics move in
  the forward pass), light ``Stateful`` objects and plain values (data loaders, samplers, user
  objects), each LR scheduler's state dict and each optimizer's hyperparameters (a scheduler
  that stepped after a skipped optimizer step moved both), and each ``GradScaler``'s scale and
  growth tracker (its ``update()`` ran after the skipped step). What would be heavy to copy is
  *proven* unmoved instead: no optimizer step began (step hooks), every parameter of every
  module has its start version counter, and every optimizer still holds its start state and
  parameter groups. A parameter that moved anyway (an EMA copy updated after a skipped
  step, a ``load_state_dict`` inside the step, an in-place change in the forward pass) means
  no exact checkpoint.
- **Every optimizer stepped** and the step's bookkeeping provably finished: the checkpoint of
  the step's end (progress advanced by one). "Finished" is checked, not assumed: every LR
  scheduler has stepped since the start, every ``GradScaler`` in use has ``update()``\ d
  after the step (no optimizer waits for it, and its scale or growth tracker changed), and
  every module that no stepped optimizer updates (an EMA copy) has changed. Light objects are
  taken as they are: they must move before ``optimizer.step()`` (a data loader does).
- **No optimizer in the state** while a module has trainable parameters (a loop that updates them
  by hand, ``p.data.add_(p.grad, alpha=-lr)``: writes through ``.data`` bump no version counter,
  so nothing proves they did not happen): no emergency checkpoint either.
- **Anything else** — an optimizer raised half-way through its update, some optimizers stepped
  and others not, a scheduler or a ``GradScaler`` has not caught up with the optimizer step,
  or one of the proofs above fails: **no emergency checkpoint** (it would mix two instants).
  The error log says why; the last committed checkpoint stays the newest and the restart
  resumes from it, exactly.

An exception inside ``Checkpointer.step`` (a failing save, a full disk) comes after the step
boundary was marked, so the start is the state after the step: the emergency checkpoint is
exactly what the failed save would have written.

Cost per step (at the boundary, never inside the step): the RNG states, copies of the light
objects, buffers, scheduler state dicts and optimizer hyperparameters, two one-element clones
per ``GradScaler``, and one version counter read per parameter.

Then the exception propagates unchanged.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import UnsupportedStateError
from ..state.adapters import Adapter
from ..state.rng import GlobalRNG
from ..state.stateful import Gradients, PerRank, is_stateful

log = logging.getLogger("unbroken")
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_HEAVY = (torch.nn.Module, torch.optim.Optimizer, *_SCHEDULERS, torch.amp.GradScaler, Gradients)


def _copy_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return copy.deepcopy(x)


PLAIN_MAX_LEAVES, PLAIN_MAX_BYTES = 10_000, 1 << 20
"""A plain value in the state is copied at every step start only up to this size; a larger one
(a dict of tensors, a long history list) is not copied (per-step cost), so a step that raises
gets no emergency checkpoint (it could not be proven exact) and the last committed one is used."""


def _small(x: Any) -> Any:
    """``x`` itself, if it is small enough to copy at every step start; else ``ValueError``."""
    leaves, size, stack = 0, 0, [x]
    while stack:
        y = stack.pop()
        if isinstance(y, dict):
            stack.extend(y.values())
        elif isinstance(y, (list, tuple, set)):
            stack.extend(y)
        else:
            leaves += 1
            size += y.numel() * y.element_size() if isinstance(y, torch.Tensor) else 0
        if leaves > PLAIN_MAX_LEAVES or size > PLAIN_MAX_BYTES:
            raise ValueError(f"too large to copy at every step start (over {PLAIN_MAX_LEAVES} values or "
                             f"{PLAIN_MAX_BYTES >> 20} MiB of tensors); wrap it in a Stateful object")
    return x


def _same(a: Any, b: Any) -> bool:
    """Whether two state-dict trees hold the same values (tensors by value, nan equal to nan)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu())))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def _scaler_values(scaler: torch.amp.GradScaler) -> tuple[torch.Tensor | float, torch.Tensor | int]:
    """The scaler's scale and growth tracker without a device sync: one-element clones, or the
    initial values while the scaler has not scaled anything yet (it creates them lazily)."""
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    return (scale.clone() if scale is not None else scaler._init_scale,
            tracker.clone() if tracker is not None else scaler._init_growth_tracker)


def _scaler_state(scaler: torch.amp.GradScaler, values: tuple[Any, Any]) -> dict[str, Any]:
    """``scaler.state_dict()`` with the scale and growth tracker of ``values`` (a sync: error path only)."""
    sd = scaler.state_dict()
    if sd:  # {} when disabled
        scale, tracker = values
        sd["scale"] = float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)
        sd["_growth_tracker"] = int(tracker.item()) if isinstance(tracker, torch.Tensor) else int(tracker)
    return sd


class StepStart:
    """What the state looked like when the current step began, and the evidence to tell later
    whether the objects too heavy to copy have moved since (see the module docstring)."""

    def __init__(self, state: Mapping[str, Any], progress: dict[str, int],
                 params: Mapping[str, list[torch.nn.Parameter]]) -> None:
        self.progress = dict(progress)
        self.rng = GlobalRNG().state_dict()  # get_state() calls already return copies
        self.light: dict[str, Any] = {}
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.versions = {key: [p._version for p in ps] for key, ps in params.items()}
        self.tensors: dict[str, tuple[torch.Tensor, int]] = {}  # plain tensors: proven, not copied
        self.schedulers: dict[str, Any] = {}
        self.optimizers: dict[str, tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]] = {}
        self.scalers: dict[str, tuple[Any, Any]] = {}
        self.lost: dict[str, str] = {}  # what could not be kept (marking a boundary never fails)
        for key, obj in state.items():
            try:
                self._keep(key, obj, params)
            except Exception as e:  # noqa: BLE001 - reported if a step raises
                self.lost[key] = f"state[{key!r}] could not be kept at the step's start ({type(e).__name__}: {e})"

    def _keep(self, key: str, obj: Any, params: Mapping[str, list[torch.nn.Parameter]]) -> None:
        """Keep what ``state[key]`` looks like now: a copy, or the evidence that it has not moved."""
        if isinstance(obj, Adapter):
            raise UnsupportedStateError(f"a {type(obj.target).__name__} is not copied at every step's start")
        if isinstance(obj, torch.nn.Module):
            names = {id(p) for p in params.get(key, ())}
            self.buffers[key] = {name: _copy_tree(t) for name, t in obj.state_dict(keep_vars=True).items()
                                 if id(t) not in names}
        elif isinstance(obj, torch.optim.Optimizer):
            hyper = [{k: _copy_tree(v) for k, v in g.items() if k != "params"} for g in obj.param_groups]
            self.optimizers[key] = (obj.state, list(obj.param_groups), hyper)
        elif isinstance(obj, _SCHEDULERS):
            self.schedulers[key] = copy.deepcopy(obj.state_dict())
        elif isinstance(obj, torch.amp.GradScaler):
            if obj.is_enabled():  # a disabled scaler has no state
                self.scalers[key] = _scaler_values(obj)
        elif isinstance(obj, torch.Tensor):
            self.tensors[key] = (obj, obj._version)
        elif is_stateful(obj) and not isinstance(obj, _HEAVY):
            self.light[key] = _copy_tree(obj.state_dict())
        elif not is_stateful(obj):
            self.light[key] = _copy_tree(_small(obj))

    def params_moved(self, state: Mapping[str, Any], params: Mapping[str, list[torch.nn.Parameter]]) -> list[str]:
        """The modules whose parameters are no longer the start's (other objects, or written in place)."""
        def same(key: str, ps: list[torch.nn.Parameter]) -> bool:
            live = list(state[key].parameters()) if key in state else []
            return (len(live) == len(ps) and all(a is b for a, b in zip(ps, live, strict=True))
                    and [p._version for p in ps] == self.versions[key])

        return [key for key, ps in params.items() if not same(key, ps)]

    def unmoved(self, state: Mapping[str, Any], params: Mapping[str, list[torch.nn.Parameter]]) -> str | None:
        """Why the objects that were not copied at the start are not as they were then, or None."""
        if self.lost:
            return next(iter(self.lost.values()))
        moved = self.params_moved(state, params)
        if moved:
            return (f"the parameters of state[{moved[0]!r}] changed without an optimizer step (written in place: an "
                    "EMA update after a skipped step, a load_state_dict, an in-place change in the forward pass)")
        for key, (tensor, version) in self.tensors.items():
            if state[key] is not tensor or tensor._version != version:
                return f"state[{key!r}] (a tensor) changed in place during the step"
        for key, (opt_state, groups, _hyper) in self.optimizers.items():
            opt = state[key]
            if opt.state is not opt_state or len(opt.param_groups) != len(groups) or any(
                    a is not b for a, b in zip(opt.param_groups, groups, strict=True)):
                return f"state[{key!r}] (an optimizer) was given other state or parameter groups during the step"
        return None

    def rebuild(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The state as of this step's start, built from live objects plus what was kept."""
        out: dict[str, Any] = dict(state)
        for key, saved in self.light.items():  # a PerRank object stays in each rank's part
            out[key] = PerRank(saved) if isinstance(state[key], PerRank) else saved
        out.update(self.schedulers)
        for key, buffers in self.buffers.items():
            sd = state[key].state_dict()
            sd.update(buffers)
            out[key] = sd
        for key, (_, _, hyper) in self.optimizers.items():
            sd = state[key].state_dict()
            sd["param_groups"] = [{**h, "params": g["params"]} for h, g in zip(hyper, sd["param_groups"], strict=True)]
            out[key] = sd
        for key, values in self.scalers.items():
            out[key] = _scaler_state(state[key], values)
        return _without_gradients(out)

    def finished(self, state: Mapping[str, Any], params: Mapping[str, list[torch.nn.Parameter]],
                 stepped: Collection[torch.optim.Optimizer]) -> str | None:
        """Why the live state is not provably the end of a step whose optimizers all stepped, or None."""
        for key, obj in state.items():
            if isinstance(obj, _SCHEDULERS) and key in self.schedulers:
                if obj.last_epoch == self.schedulers[key].get("last_epoch"):
                    return (f"state[{key!r}] (an LR scheduler) has not stepped since the optimizer did (the "
                            "exception may have come before scheduler.step(), or it does not step every step)")
            elif (isinstance(obj, torch.amp.GradScaler) and key in self.scalers and obj.is_enabled()
                  and getattr(obj, "_scale", None) is not None):  # a scaler that never scaled has nothing to update
                if any(st.get("stage") is not None and st["stage"].name != "READY"
                       for st in getattr(obj, "_per_optimizer_states", {}).values()):
                    return f"state[{key!r}] (GradScaler) stepped the optimizer but update() was not called"
                if _scaler_state(obj, _scaler_values(obj)) == _scaler_state(obj, self.scalers[key]):
                    return f"state[{key!r}] (GradScaler) has not run update() since the optimizer stepped"
        updated = {id(p) for opt in stepped for g in opt.param_groups for p in g["params"]}
        moved = set(self.params_moved(state, params))
        for key, ps in params.items():
            if not ps or any(id(p) in updated for p in ps) or key in moved:
                continue
            if key not in self.buffers:
                return self.lost.get(key, f"state[{key!r}] was not kept at the step's start")
            live = {k: v for k, v in state[key].state_dict().items() if k in self.buffers[key]}
            if _same(live, self.buffers[key]):
                return (f"state[{key!r}] (a module no stepped optimizer updates, e.g. an EMA copy) has not changed "
                        "since the optimizer stepped")
        return None


def _without_gradients(out: dict[str, Any]) -> dict[str, Any]:
    """At a step boundary no gradient of the next step is accumulated yet: ``Gradients`` are empty."""
    for key, obj in list(out.items()):
        if isinstance(obj, Gradients):
            out[key] = {name: None for name, _ in obj.module.named_parameters()}
    return out


@dataclass(frozen=True)
class Verdict:
    """Which instant an emergency checkpoint can describe: ``"start"`` or ``"end"`` of the
    failed step, or ``None`` with ``why`` no checkpoint would be exact."""

    instant: Literal["start", "end"] | None
    why: str = ""


class StepGuard:
    """Context manager returned by :meth:`unbroken.Checkpointer.guard`.

    ``attach(guard_or_None)`` tells the Checkpointer which guard to :meth:`mark` at each
    step boundary; ``on_error(guard, exc)`` writes the emergency checkpoint (after
    :meth:`verdict`). Keys in ``unsaved`` (``allow_unsaved``) are neither kept nor checked.
    """

    def __init__(self, state: Mapping[str, Any], progress: Any, attach: Callable[[Any], None],
                 on_error: Callable[[StepGuard, BaseException | None], Any], unsaved: Collection[str] = ()) -> None:
        self._live, self._unsaved = state, frozenset(unsaved)
        self.progress = progress
        self.attach, self.on_error = attach, on_error
        self.start: StepStart | None = None
        self._stepping: set[int] = set()  # ids of optimizers whose update began and has not ended
        self._stepped: dict[int, torch.optim.Optimizer] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._params: dict[str, list[torch.nn.Parameter]] = {}
        self._hooks: list[Any] = []

    @property
    def state(self) -> dict[str, Any]:
        """The saved part of the guarded state (its live objects)."""
        return {k: v for k, v in self._live.items() if k not in self._unsaved}

    @property
    def stepped(self) -> bool:
        """Whether an optimizer completed a step since the step began."""
        return bool(self._stepped)

    def prepare(self, progress: dict[str, int]) -> StepStart:
        """What the next step's start looks like, with ``progress`` as its counters: computed
        before anything changes, so that marking the boundary cannot fail half-way."""
        return StepStart(self.state, progress, self._params)

    def mark(self, start: StepStart | None = None) -> None:
        """A new step begins now (``start``: from :meth:`prepare`)."""
        self.start = start if start is not None else self.prepare(self.progress.state_dict())
        self._stepping.clear()
        self._stepped.clear()

    def verdict(self) -> Verdict:
        """Which instant the live state can be saved as, judged from the evidence kept at the start."""
        start, state = self.start, self.state
        assert start is not None
        if self._stepping:
            return Verdict(None, "the optimizer was stepping (some parameters may be updated, others not)")
        swapped = [k for k, opt in self._optimizers.items() if state.get(k) is not opt] + [
            k for k, obj in state.items()
            if isinstance(obj, torch.optim.Optimizer) and self._optimizers.get(k) is not obj
            or isinstance(obj, torch.nn.Module) and k not in self._params]
        if swapped:
            return Verdict(None, f"state[{swapped[0]!r}] was replaced or added after the guard began watching")
        if not self._optimizers and any(p.requires_grad for ps in self._params.values() for p in ps):
            return Verdict(None, "the state holds no optimizer: parameters updated by hand (p.data.add_(...)) "
                                 "leave no trace in version counters, so they cannot be proven unmoved")
        if not self._stepped:
            why = start.unmoved(state, self._params)
            return Verdict("start") if why is None else Verdict(None, why)
        waiting = [k for k, opt in self._optimizers.items() if id(opt) not in self._stepped]
        if waiting:
            done = next(k for k, opt in self._optimizers.items() if id(opt) in self._stepped)
            return Verdict(None, f"state[{done!r}] stepped but state[{waiting[0]!r}] (another optimizer) did not")
        why = start.finished(state, self._params, self._stepped.values())
        return Verdict("end") if why is None else Verdict(None, why)

    def end_state(self) -> dict[str, Any]:
        """The live state as the end of the step (no gradients accumulated for the next one)."""
        return _without_gradients(dict(self.state))

    def _on_optimizer_pre_step(self, optimizer: Any, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The update begins, unless ``step`` got a closure (Lightning, LBFGS): the closure runs the
        forward and backward pass *inside* ``step`` and changes no parameter, so the update begins
        only once it returns; an exception in it leaves the step cleanly not begun."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is None:
            self._stepping.add(id(optimizer))
            return None

        def closure_then_update() -> Any:
            result = closure()
            self._stepping.add(id(optimizer))
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_update}
        return (args[0], closure_then_update, *args[2:]), kwargs

    def _on_optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self._stepped[id(optimizer)] = optimizer
        self._stepping.discard(id(optimizer))

    def __enter__(self) -> StepGuard:
        for key, obj in self.state.items():
            if isinstance(obj, torch.optim.Optimizer):
                self._optimizers[key] = obj
                self._hooks.append(obj.register_step_pre_hook(self._on_optimizer_pre_step))
                self._hooks.append(obj.register_step_post_hook(self._on_optimizer_step))
            elif isinstance(obj, torch.nn.Module):
                self._params[key] = list(obj.parameters())
        self.mark()
        self.attach(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.attach(None)
        if exc_type is None or issubclass(exc_type, (SystemExit, GeneratorExit)):
            return False
        try:
            self.on_error(self, exc)  # may end the process as a preemption (SystemExit 75)
        except Exception as err:  # noqa: BLE001 - never hide the original exception
            log.error("emergency checkpoint failed: %s: %s", type(err).__name__, err)
        return False
