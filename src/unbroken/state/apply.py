"""Putting a decoded checkpoint back into the live training state, in place.

The live state is the dict the user passes to ``restore``/``load``. Its objects keep
their identity: ``Stateful`` objects get ``load_state_dict`` (an optimizer's saved state
copied first into the state tensors it already holds, where they fit), dicts and lists are
updated in place, tensors are copied into (same shape and dtype) or replaced,
generators get their state set. Plain values are replaced in their container.
Before anything is touched, the top-level keys are compared, the saved state of
every :class:`~unbroken.Progress` and global-RNG object is validated, every module's
tensors are compared with the saved ones (keys, shapes, dtypes) and every torch optimizer
and LR scheduler with the saved one's class (:func:`check_state`), so a mismatch or a
malformed counter or RNG state fails without half-restoring the state.

What cannot be checked beforehand is a user object's own ``load_state_dict`` (a scheduler, a
scaler, a data loader, any ``Stateful``): those are loaded *first*, each with a copy of its
current state to put back, so when one refuses, the ones already loaded are rolled back and
the modules and optimizers (checked, then loaded last) were never touched
(:func:`apply_parts`): a refused restore leaves the state as it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, MutableMapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, StateMismatchError
from .adapters import Adapter
from .codec import PathT, StatefulValue, qualname, render_path
from .copying import Copies, copy_into, fresh_copy, into_module
from .rng import GlobalRNG
from .stateful import PerRank, Progress, is_stateful


def check_keys(live: MutableMapping[str, Any], saved: dict[str, Any], strict: bool) -> None:
    """Refuse (when ``strict``) a checkpoint whose top-level keys differ from the state's."""
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"in the state but not in the checkpoint: {missing}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the state: {unexpected}")
        raise StateMismatchError(
            "the checkpoint does not match the state (" + "; ".join(parts) + "). Pass the same keys "
            "that were saved, or strict=False to restore only the keys both have."
        )


def check_state(live: Any, saved: Any, path: PathT = ()) -> None:
    """Check, changing nothing, what can be checked before ``saved`` is applied to ``live``:
    the state of every :class:`~unbroken.Progress` and global-RNG object in ``live`` (found
    where :func:`apply_state` would load it) is validated with its ``check``. Raises
    :class:`CorruptCheckpointError` or :class:`StateMismatchError` naming the place."""
    if isinstance(live, PerRank):
        live = live.obj
    if isinstance(live, (Progress, GlobalRNG)):
        try:
            live.check(saved)
        except (CorruptCheckpointError, StateMismatchError) as e:
            raise type(e)(f"{render_path(path)}: {e}") from None
        return
    if isinstance(live, Adapter) and isinstance(saved, StatefulValue):
        try:
            live.check(saved.value)
        except StateMismatchError as e:
            raise StateMismatchError(f"{render_path(path)}: {e}") from None
        return
    if is_stateful(live):
        if isinstance(saved, StatefulValue):
            _check_stateful(live, saved, path)
        return
    if isinstance(live, MutableMapping) and isinstance(saved, dict):
        for k, v in saved.items():
            if k in live:
                check_state(live[k], v, path + (k,))
    elif type(live) is list and type(saved) is list and len(live) == len(saved):
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            check_state(a, b, path + (i,))


def apply_state(live: MutableMapping[str, Any], saved: dict[str, Any], strict: bool = True) -> None:
    """Load ``saved`` into ``live`` in place, all or nothing (see the module docstring)."""
    check_keys(live, saved, strict)
    check_state(live, saved)
    apply_parts([(live, saved)])


UNDO_MAX_BYTES = 256 * 1024 * 1024
"""An object whose state holds more tensor bytes than this is not copied for a rollback (a
``Stateful`` wrapping a whole model would double its memory at restore); it is loaded with the
checked modules instead."""


def _undo_copy(obj: Any) -> Any:
    """A copy of ``obj``'s state to put back if a later part refuses, or ``None`` when ``obj`` is
    checked beforehand (a module, an optimizer) or too large to copy (:data:`UNDO_MAX_BYTES`)."""
    if not is_stateful(obj) or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, Adapter)):
        return None
    state = obj.state_dict()
    size, stack = 0, [state]
    while stack and size <= UNDO_MAX_BYTES:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            size += x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return _own(state, {}) if size <= UNDO_MAX_BYTES else None


def apply_parts(parts: list[tuple[MutableMapping[str, Any], dict[str, Any]]],
                between: Callable[[], None] | None = None, late: Callable[[Any], bool] | None = None) -> None:
    """Load each ``(live, saved)`` pair (already checked) in place, all or nothing: first every
    top-level object whose own ``load_state_dict`` may refuse, each with a copy of its state to
    roll back to (:func:`_undo_copy`); if one raises, those loaded are put back and the error is
    raised with nothing else touched. Then ``between()`` (sharded tensors are loaded there) and
    the rest: modules, optimizers, tensors and plain values, whose fit :func:`check_state`
    proved, large objects, and the saved values ``late`` picks (those ``between`` completes); if
    one of those still raises, the objects of the first pass are put back too."""
    undo: list[tuple[Any, Any]] = []
    done: set[tuple[int, str]] = set()
    try:
        for i, (live, saved) in enumerate(parts):
            for key, value in saved.items():
                if key not in live or (late and late(value)):
                    continue
                before = _undo_copy(live[key])
                if before is not None:
                    undo.append((live[key], before))
                    live[key] = _apply(live[key], value, (key,))
                    done.add((i, key))
        if between is not None:
            between()
        for i, (live, saved) in enumerate(parts):
            for key, value in saved.items():
                if key in live and (i, key) not in done:
                    live[key] = _apply(live[key], value, (key,))
    except BaseException:
        for obj, before in reversed(undo):
            try:
                obj.load_state_dict(before)
            except Exception as e:  # noqa: BLE001 - the original error is the one to raise
                warnings.warn(f"could not put back the state of a {type(obj).__name__} after a refused restore: "
                              f"{type(e).__name__}: {e}", stacklevel=2)
        raise


def _check_stateful(live: Any, saved: StatefulValue, path: PathT) -> None:
    """What ``load_state_dict`` would get wrong only half-way or silently: a torch optimizer or
    LR scheduler of another class (Adam moments into SGD fail at the next step; a LambdaLR
    state into StepLR changes the schedule), and a module whose tensors do not match the
    saved ones (``load_state_dict`` copies the matching ones before it raises, and casts
    dtypes silently). Raises :class:`StateMismatchError`, changing nothing."""
    where = render_path(path)
    cls = qualname(live)
    if cls != saved.cls and cls.startswith("torch.optim.") and saved.cls.startswith("torch.optim."):
        raise StateMismatchError(
            f"{where} was saved from a {saved.cls}, but the state holds a {cls}: its state would not "
            "fit. To continue with a new optimizer or scheduler on purpose, leave it out of the state "
            "you restore (restore the rest with strict=False) and create it fresh.")
    if isinstance(live, torch.optim.Optimizer) and isinstance(saved.value, dict):
        _check_optimizer(live, saved.value, where)
    if not isinstance(live, torch.nn.Module) or not isinstance(saved.value, dict):
        return
    want = {k: v for k, v in live.state_dict().items() if isinstance(v, torch.Tensor)}
    have = saved.value
    missing = [k for k in want if k not in have]
    unexpected = [k for k, v in have.items() if k not in want and isinstance(v, torch.Tensor)]
    wrong = []
    for k, t in want.items():
        v = have.get(k)
        if isinstance(v, torch.Tensor) and type(t) is torch.Tensor and (v.shape != t.shape or v.dtype != t.dtype):
            wrong.append(f"{k}: saved {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}, the model has "
                         f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
    problems = ([f"missing from the checkpoint: {missing[:5]}"] if missing else []) + \
        ([f"not in the model: {unexpected[:5]}"] if unexpected else []) + wrong[:5]
    if problems:
        raise StateMismatchError(
            f"{where} does not match the checkpoint ({'; '.join(problems)}). Nothing was loaded: "
            "build the model as it was when saved (sizes, dtype; convert after loading).")


def _check_optimizer(live: torch.optim.Optimizer, saved: dict[str, Any], where: str) -> None:
    """What ``Optimizer.load_state_dict`` refuses: another number of parameter groups or of
    parameters in a group (checked here, so it is refused before the model is loaded)."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list):
        return
    have = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in groups]
    want = [len(g["params"]) for g in live.param_groups]
    if have != want:
        raise StateMismatchError(
            f"{where} does not match the checkpoint: it was saved with parameter groups of {have} parameters, "
            f"the optimizer has {want}. Nothing was loaded: build the optimizer over the same parameters "
            "(and groups) as when saved.")


def _own(x: Any, memo: dict[int, torch.Tensor]) -> Any:
    """``x`` with every tensor copied into memory of its own, aliases kept. Loaded tensors are
    views of the checkpoint's file buffer or of a mapping of the file: an object that keeps
    them (an optimizer's ``load_state_dict`` adopts its state tensors) must not keep the file
    alive, nor copy-on-write pages of a mapping (slow first writes, and bytes that would follow
    the file rather than what was verified). Modules copy into their parameters: no copy."""
    copies = Copies()
    out = _owned(x, memo, copies)
    copies.run()  # all the copies at once (:class:`unbroken.state.copying.Copies`)
    return out


def _owned(x: Any, memo: dict[int, torch.Tensor], copies: Copies) -> Any:
    if isinstance(x, torch.Tensor):
        if id(x) not in memo:
            memo[id(x)] = copies.fresh(x)
        return memo[id(x)]
    if type(x) is dict:
        return {k: _owned(v, memo, copies) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_owned(v, memo, copies) for v in x)
    return x


def _owns_storage(t: torch.Tensor) -> bool:
    """``t`` is a plain dense tensor that alone fills its storage (no view of a larger buffer)."""
    return type(t) is torch.Tensor and t.layout == torch.strided and t.is_contiguous() and \
        t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _into_optimizer_state(live: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[int, torch.Tensor]:
    """Copy the saved optimizer state into the tensors the live optimizer already holds for it
    (same parameter index and key, shape, dtype and device), the way a module copies into its
    parameters: no fresh memory to fault in, no clone of state that was loaded in place (FSDP's
    sharded state is the live tensor itself). Returns ``{id(saved tensor): live tensor}`` for
    :func:`_own`, which clones only the rest. A live tensor is reused at most once, and only
    when it fills its own storage, so no two saved tensors can land in the same memory. An
    optimizer with its own ``state_dict`` (``ZeroRedundancyOptimizer``, wrappers) is left to it."""
    reuse: dict[int, torch.Tensor] = {}
    saved_state = saved.get("state")
    if not isinstance(saved_state, dict) or not live.state or \
            type(live).state_dict is not torch.optim.Optimizer.state_dict:
        return reuse
    current = live.state_dict()["state"]
    taken: set[int] = set()
    copies = Copies()
    for idx, entries in saved_state.items():
        have = current.get(idx)
        if not isinstance(entries, dict) or not isinstance(have, dict):
            continue
        for key, src in entries.items():
            dst = have.get(key)
            if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor) or id(src) in reuse:
                continue
            if dst is src:  # loaded in place already (sharded state through DCP)
                reuse[id(src)] = dst
                continue
            if type(src) is not torch.Tensor or not _owns_storage(dst) or dst.shape != src.shape or \
                    dst.dtype != src.dtype or dst.device != src.device or dst.is_inference() or \
                    dst.untyped_storage().data_ptr() in taken:
                continue
            copies.into(dst, src)
            reuse[id(src)] = dst
            taken.add(dst.untyped_storage().data_ptr())
    copies.run()
    return reuse


def _apply(live: Any, saved: Any, path: PathT) -> Any:
    if is_stateful(live):
        value = saved.value if isinstance(saved, StatefulValue) else saved
        if isinstance(live, torch.optim.Optimizer) and isinstance(value, dict):
            value = _own(value, _into_optimizer_state(live, value))  # no fresh copy of state it already has
        elif isinstance(live, torch.nn.Module):  # a module copies into its parameters (no fresh memory)
            value = into_module(live, value) if isinstance(value, dict) else value
        else:  # others may keep what they are given
            value = _own(value, {})
        try:
            live.load_state_dict(value)
        except (CorruptCheckpointError, StateMismatchError):
            raise
        except Exception as e:
            raise StateMismatchError(
                f"{render_path(path)}.load_state_dict() rejected the checkpoint: {type(e).__name__}: {e}"
            ) from e
        return live
    if isinstance(saved, StatefulValue):
        raise StateMismatchError(
            f"{render_path(path)} was saved from a {saved.cls} but the state now holds a "
            f"{type(live).__name__}; pass the object itself (it must have load_state_dict)."
        )
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        if live.shape == saved.shape and live.dtype == saved.dtype and not live.is_inference():
            copy_into(live, saved)
            return live
        return fresh_copy(saved) if saved.device == live.device else saved.to(live.device)  # a copy either way
    if isinstance(live, dict) and isinstance(saved, dict):
        for k in [k for k in live if k not in saved]:
            del live[k]
        for k, v in saved.items():
            live[k] = _apply(live[k], v, path + (k,)) if k in live else _own(v, {})
        return live
    if type(live) is list and type(saved) is list:
        if len(live) == len(saved):
            live[:] = [_apply(a, b, path + (i,)) for i, (a, b) in enumerate(zip(live, saved, strict=True))]
        else:
            live[:] = _own(saved, {})
        return live
    if type(live) is torch.Generator and type(saved) is torch.Generator:
        live.set_state(saved.get_state())
        return live
    if type(live) is np.random.Generator and type(saved) is np.random.Generator:
        live.bit_generator.state = saved.bit_generator.state
        return live
    if type(live) is np.random.RandomState and type(saved) is np.random.RandomState:
        live.set_state(saved.get_state())
        return live
    if hasattr(live, "setstate") and type(live) is type(saved) and hasattr(saved, "getstate"):
        live.setstate(saved.getstate())  # random.Random
        return live
    return _own(saved, {})
