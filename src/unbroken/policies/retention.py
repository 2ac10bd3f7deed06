"""Retention: what to keep. See :mod:`unbroken.policies`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .triggers import Mode, _check_mode, _flatten, _positive_int, metric_value


@dataclass(frozen=True)
class CheckpointMeta:
    """What retention rules see of one committed checkpoint."""

    name: str
    step: int
    seq: int
    metrics: Mapping[str, Any] = field(default_factory=dict)
    tags: frozenset[str] = frozenset()

    @classmethod
    def of(cls, info: Any, tags: Iterable[str] | None = None) -> CheckpointMeta:
        """From a :class:`~unbroken.CheckpointInfo` (tags from ``info.tags`` if it has them)."""
        tags = getattr(info, "tags", ()) if tags is None else tags
        return cls(info.name, info.step, info.seq, dict(info.metrics), frozenset(tags or ()))


@runtime_checkable
class Retention(Protocol):
    """Names the checkpoints to keep; everything else may be deleted (see :func:`to_delete`)."""

    def keep(self, checkpoints: Sequence[CheckpointMeta]) -> set[str]: ...


class _RetentionOps:
    """``a | b`` for the built-in rules (any object with ``keep`` may be the other side)."""

    def __or__(self, other: Retention) -> Union:
        return Union(self, other)  # type: ignore[arg-type]

    def __ror__(self, other: Retention) -> Union:
        return Union(other, self)  # type: ignore[arg-type]


def _newest_first(checkpoints: Iterable[CheckpointMeta]) -> list[CheckpointMeta]:
    return sorted(checkpoints, key=lambda c: (c.seq, c.step, c.name), reverse=True)


@dataclass
class KeepLast(_RetentionOps):
    """The ``k`` most recently committed checkpoints (highest ``seq``)."""

    k: int

    def __post_init__(self) -> None:
        _positive_int(self.k, "KeepLast(k)")

    def keep(self, checkpoints: Sequence[CheckpointMeta]) -> set[str]:
        return {c.name for c in _newest_first(checkpoints)[: self.k]}


@dataclass
class KeepBest(_RetentionOps):
    """The ``k`` checkpoints with the best ``metric`` (lowest for ``mode="min"``). Without
    the metric or with NaN, never "best"; on a tie the newer one (higher ``seq``) wins."""

    k: int
    metric: str
    mode: Mode = "min"

    def __post_init__(self) -> None:
        _positive_int(self.k, "KeepBest(k)")
        _check_mode(self.mode)

    def ranked(self, checkpoints: Sequence[CheckpointMeta]) -> list[CheckpointMeta]:
        """Checkpoints that have a usable value, best first."""
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [(v, c) for c in checkpoints
                  if (v := metric_value(c.metrics, self.metric)) is not None and not math.isnan(v)]
        scored.sort(key=lambda vc: (sign * vc[0], -vc[1].seq, -vc[1].step))
        return [c for _, c in scored]

    def keep(self, checkpoints: Sequence[CheckpointMeta]) -> set[str]:
        return {c.name for c in self.ranked(checkpoints)[: self.k]}


@dataclass
class KeepEveryNSteps(_RetentionOps):
    """Every checkpoint whose step is a multiple of ``n``, forever (milestones)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "KeepEveryNSteps(n)")

    def keep(self, checkpoints: Sequence[CheckpointMeta]) -> set[str]:
        return {c.name for c in checkpoints if c.step % self.n == 0}


@dataclass(init=False)
class KeepTagged(_RetentionOps):
    """Checkpoints carrying any tag, or with ``tags`` given, any of those tags."""

    tags: frozenset[str]

    def __init__(self, *tags: str) -> None:
        self.tags = frozenset(tags)

    def keep(self, checkpoints: Sequence[CheckpointMeta]) -> set[str]:
        return {c.name for c in checkpoints if (c.tags & self.tags if self.tags else c.tags)}


@dataclass
class KeepAll(_RetentionOps):
    """Every checkpoint (retention off)."""

    def keep(self, checkpoints: Sequence[CheckpointMeta]) -> set[str]:
        return {c.name for c in checkpoints}


class Union(_RetentionOps):
    """Keeps a checkpoint if any of ``policies`` keeps it."""

    def __init__(self, *policies: Retention) -> None:
        self.policies: tuple[Retention, ...] = _flatten(policies, Union, "policies", "keep")

    def keep(self, checkpoints: Sequence[CheckpointMeta]) -> set[str]:
        return set().union(*(p.keep(checkpoints) for p in self.policies))

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


def to_delete(policy: Retention, checkpoints: Sequence[CheckpointMeta], *,
              protect: Iterable[str] = ()) -> list[str]:
    """Names of ``checkpoints`` that ``policy`` does not keep, oldest first (delete in
    this order). Never the newest (highest ``seq``) nor a name in ``protect`` (just
    committed, being written), whatever the policy says. Pure, so running it again
    after an interrupted pruning finishes the job."""
    if not checkpoints:
        return []
    ordered = _newest_first(checkpoints)
    spared = set(policy.keep(ordered)) | set(protect) | {ordered[0].name}
    return [c.name for c in reversed(ordered) if c.name not in spared]
