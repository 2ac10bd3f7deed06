"""Which values of a state get an :class:`~unbroken.state.adapters.Adapter`, and the adapted view.

:func:`adapt` is called at every public entry that takes the state (``Checkpointer.save``,
``step``, ``restore``, ``guard``, ``end_epoch``; ``unbroken.save``/``load``). Today one kind
is adapted: a ``deepspeed.DeepSpeedEngine`` (:mod:`unbroken.dist.deepspeed`), recognised only
when DeepSpeed is already imported, so a run without it pays a dictionary lookup per value.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from ..state.adapters import Adapter


def _deepspeed_engine(obj: Any) -> bool:
    ds = sys.modules.get("deepspeed")
    engine = getattr(ds, "DeepSpeedEngine", None) if ds is not None else None
    return engine is not None and isinstance(obj, engine)


def _deepspeed_adapter(obj: Any) -> Adapter:
    from ..dist.deepspeed import DeepSpeedState

    return DeepSpeedState(obj)


_KINDS: list[tuple[Callable[[Any], bool], Callable[[Any], Adapter]]] = [(_deepspeed_engine, _deepspeed_adapter)]
_made: weakref.WeakKeyDictionary[Any, Adapter] = weakref.WeakKeyDictionary()


def adapter_for(obj: Any) -> Adapter | None:
    """The adapter of ``obj`` (the same one every time), or ``None`` if it needs none."""
    for wants, make in _KINDS:
        if wants(obj):
            found = _made.get(obj)
            if found is None:
                found = _made[obj] = make(obj)
            return found
    return None


class AdaptedState(MutableMapping):
    """The user's state mapping, with adapters in place of the objects that need one. Writes go
    through to the user's mapping (a restored plain value replaces the user's)."""

    def __init__(self, state: MutableMapping[str, Any] | Mapping[str, Any]) -> None:
        self.state = state

    def __getitem__(self, key: str) -> Any:
        value = self.state[key]
        return adapter_for(value) or value

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, Adapter) and value.target is self.state.get(key):
            return  # the adapter loaded the live object in place
        self.state[key] = value  # type: ignore[index]

    def __delitem__(self, key: str) -> None:
        del self.state[key]  # type: ignore[union-attr]  # a read-only mapping raises, as it should

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def adapt(state: Mapping[str, Any]) -> Any:
    """``state`` as unbroken sees it: itself when no top-level value needs an adapter (the usual
    case, checked per step at the cost of a type test per key), else an :class:`AdaptedState`."""
    if isinstance(state, AdaptedState) or not any(adapter_for(v) is not None for v in state.values()):
        return state
    return AdaptedState(state)
