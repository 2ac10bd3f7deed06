"""Objects whose own ``state_dict()`` is not their training state get an adapter.

A DeepSpeed engine is an ``nn.Module``: its ``state_dict()`` is the module's weights only
(under ZeRO-3, empty placeholders), not the partitioned fp32 master weights and optimizer
moments that a resume needs. Saved as it is, it would resume silently wrong. So the state
the user passes (``{"engine": engine, "data": loader}``) is seen through :func:`adapt`:
such a value is replaced, for unbroken only, by an :class:`Adapter` that saves and restores
the whole training state of the object. The user's dict is never changed.

An adapter is a ``Stateful`` with three more duties: ``check(saved)`` refuses a checkpoint
that does not fit before anything is loaded, ``prepare_load(saved)`` makes the live object
ready to be loaded into (optimizer state that does not exist yet), and it is loaded with
the modules, after every checked part (it is too large to copy for a rollback).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Callable


class Adapter:
    """Base of the adapters: the training state of one live object (``self.target``)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Any) -> None:
        raise NotImplementedError

    def check(self, saved: Any) -> None:
        """Raise :class:`~unbroken.errors.StateMismatchError` if ``saved`` cannot be loaded; change nothing."""

    def prepare_load(self, saved: Any) -> None:
        """Called (on every rank) before sharded pieces are loaded into :meth:`state_dict`'s tensors."""


def _deepspeed_engine(obj: Any) -> bool:
    ds = sys.modules.get("deepspeed")
    engine = getattr(ds, "DeepSpeedEngine", None) if ds is not None else None
    return engine is not None and isinstance(obj, engine)


def _deepspeed_adapter(obj: Any) -> Adapter:
    from ..integrations.deepspeed import DeepSpeedState

    return DeepSpeedState(obj)


_KINDS: list[tuple[Callable[[Any], bool], Callable[[Any], Adapter]]] = [(_deepspeed_engine, _deepspeed_adapter)]
_made: "weakref.WeakKeyDictionary[Any, Adapter]" = weakref.WeakKeyDictionary()


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
        del self.state[key]  # type: ignore[attr-defined]

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
