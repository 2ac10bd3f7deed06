"""What the fault paths use of a :class:`~unbroken.Checkpointer`: its public API, as a ``Protocol``.

``faults/`` sits below ``checkpointer/`` (docs/architecture.md), so the preemption exit, the emergency
save after a failed step and ``recover()`` cannot import the Checkpointer; each is handed it and types
it by :class:`Host`. Every call that hands one over is checked against the real class by mypy, so a
Checkpointer that stopped offering what these paths use fails the type gate, not a preemption.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Literal, Protocol

from ..api import CheckpointInfo
from ..dist.comm import Comm
from ..events import EventBus
from ..state.stateful import Progress
from . import Preemption


class Host(Protocol):
    """The Checkpointer, as the fault paths see it (see the module docstring)."""

    location: str
    progress: Progress
    comm: Comm
    events: EventBus
    preemption: Preemption

    @property
    def last_saved(self) -> CheckpointInfo | None: ...

    def save(self, state: Mapping[str, Any], metrics: dict[str, Any] | None = None, *, kind: str = "regular",
             tag: str | None = None, progress: Mapping[str, int] | None = None,
             rng: Mapping[str, Any] | None = None) -> CheckpointInfo | None: ...

    def step(self, state: Mapping[str, Any], **metrics: Any) -> CheckpointInfo | None: ...

    def restore(self, state: MutableMapping[str, Any], path: Any = None, *, tag: str | None = None,
                if_unrestorable: Literal["raise", "start_fresh"] = "raise") -> CheckpointInfo | None: ...

    def flush(self, raise_errors: bool = True) -> CheckpointInfo | None: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def latest(self) -> CheckpointInfo | None: ...

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]: ...

    def close(self) -> None: ...
