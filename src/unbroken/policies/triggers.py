"""Triggers: when to save. See :mod:`unbroken.policies`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Mode = Literal["min", "max"]
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def metric_value(metrics: Mapping[str, Any], name: str) -> float | None:
    """``metrics[name]`` as a float, or ``None`` if it is absent or not a number."""
    v: Any = metrics.get(name)
    if isinstance(v, str):
        return _NON_FINITE.get(v.strip().lower())
    if callable(getattr(v, "item", None)) and not isinstance(v, (int, float)):
        try:
            v = v.item()  # a 0-d tensor (a GPU sync) or a numpy scalar
        except (ValueError, RuntimeError):
            return None  # more than one element
    return None if isinstance(v, bool) or not isinstance(v, (int, float)) else float(v)


def _positive_int(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _check_mode(mode: str) -> Mode:
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' (lower is better) or 'max', got {mode!r}")
    return mode  # type: ignore[return-value]


def _flatten(items: tuple[Any, ...], kind: type, attr: str, method: str) -> tuple[Any, ...]:
    flat: list[Any] = []
    for x in items:
        if not callable(getattr(x, method, None)):
            raise TypeError(f"{x!r} cannot go into {kind.__name__}: it has no {method}() method")
        flat.extend(getattr(x, attr) if isinstance(x, kind) else (x,))
    if not flat:
        raise ValueError(f"{kind.__name__} needs at least one rule")
    return tuple(flat)


# ------------------------------------------------------------------------ triggers
@dataclass(frozen=True)
class TriggerContext:
    """What a trigger may look at. ``now``/``last_save_time`` are this process's
    ``time.monotonic()`` seconds; the ``last_save_*`` are ``None`` before its first save."""

    step: int
    epoch: int = 0
    epoch_end: bool = False
    now: float = 0.0
    last_save_step: int | None = None
    last_save_time: float | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Trigger(Protocol):
    """Decides whether a save is due. Stateful triggers also have ``state_dict()`` and
    ``load_state_dict(d)`` returning/taking plain values (no pickle)."""

    def due(self, ctx: TriggerContext) -> bool: ...


class _TriggerOps:
    """``a | b`` for the built-in triggers (any object with ``due`` may be the other side)."""

    def __or__(self, other: Trigger) -> AnyOf:
        return AnyOf(self, other)  # type: ignore[arg-type]

    def __ror__(self, other: Trigger) -> AnyOf:
        return AnyOf(other, self)  # type: ignore[arg-type]


@dataclass
class EveryNSteps(_TriggerOps):
    """Due at every step that is a positive multiple of ``n`` (aligned, like ``save_every``); at
    steps only, not again at an epoch's end that falls on such a step (that step is saved already)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "EveryNSteps(n)")

    def due(self, ctx: TriggerContext) -> bool:
        return ctx.step > 0 and ctx.step % self.n == 0 and not ctx.epoch_end


@dataclass
class EveryMinutes(_TriggerOps):
    """Due ``minutes`` after the last save or, before this process's first save, after
    this trigger was first asked (monotonic time does not survive a resume)."""

    minutes: float
    _started: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.minutes, (int, float)) and 0 < self.minutes < math.inf):
            raise ValueError(f"EveryMinutes(minutes) must be a positive number, got {self.minutes!r}")

    def due(self, ctx: TriggerContext) -> bool:
        if self._started is None:
            self._started = ctx.now
        since = ctx.last_save_time if ctx.last_save_time is not None else self._started
        return ctx.now - since >= self.minutes * 60.0


@dataclass
class AtEpochEnd(_TriggerOps):
    """Due when the loop signals the end of an epoch."""

    def due(self, ctx: TriggerContext) -> bool:
        return ctx.epoch_end


@dataclass
class OnImprovement(_TriggerOps):
    """Due when ``metric`` beats the best value seen so far by more than ``min_delta``.

    The first value is an improvement; NaN never is, and is never remembered; a stale
    value repeated does not improve on itself; no metric, not due. Checkpoint
    :meth:`state_dict` and load it on resume, or the resumed run saves on its first value.
    """

    metric: str
    mode: Mode = "min"
    min_delta: float = 0.0
    best: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        _check_mode(self.mode)
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise ValueError(f"min_delta must be a finite number >= 0, got {self.min_delta!r}")

    def improves(self, value: float) -> bool:
        """Whether ``value`` would be an improvement (pure: remembers nothing)."""
        if math.isnan(value) or self.best is None:
            return not math.isnan(value)
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def due(self, ctx: TriggerContext) -> bool:
        value = metric_value(ctx.metrics, self.metric)
        if value is None or not self.improves(value):
            return False
        self.best = value
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "best": self.best}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved = (state_dict.get("metric", self.metric), state_dict.get("mode", self.mode))
        if saved != (self.metric, self.mode):
            warnings.warn(f"OnImprovement: the checkpoint tracked {saved[0]!r} ({saved[1]}), this run "
                          f"{self.metric!r} ({self.mode}); starting without a best value", stacklevel=2)
        best = state_dict.get("best") if saved == (self.metric, self.mode) else None
        self.best = None if best is None else float(best)


class AnyOf(_TriggerOps):
    """Due when any of ``triggers`` is due. Every trigger is asked at every step (no
    short-circuit), so stateful ones such as :class:`OnImprovement` see every value. The
    state of the n-th stateful trigger of a class is saved as ``"<Class>#n"``: adding,
    removing or reordering triggers of other classes keeps it loadable."""

    def __init__(self, *triggers: Trigger) -> None:
        self.triggers: tuple[Trigger, ...] = _flatten(triggers, AnyOf, "triggers", "due")

    def due(self, ctx: TriggerContext) -> bool:
        return any([t.due(ctx) for t in self.triggers])  # noqa: C419 -- a list: ask all, no short-circuit

    def _keys(self) -> list[tuple[str, Any]]:
        stateful = [t for t in self.triggers if callable(getattr(t, "state_dict", None))]
        names = [type(t).__name__ for t in stateful]
        return [(f"{n}#{names[:i].count(n)}", t) for i, (n, t) in enumerate(zip(names, stateful, strict=True))]

    def state_dict(self) -> dict[str, Any]:
        return {key: t.state_dict() for key, t in self._keys()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for key, t in self._keys():
            if key in state_dict:
                t.load_state_dict(state_dict[key])
            else:
                warnings.warn(f"AnyOf: no saved state for {key} (triggers changed?); it starts fresh", stacklevel=2)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.triggers))
