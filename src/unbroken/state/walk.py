"""Finding the objects of a kind in a training state (values, and dicts, lists and tuples of them)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def instances(x: Any, kind: type[T] | tuple[type, ...], depth: int = 4) -> Iterator[T]:
    """Every object of ``kind`` in ``x``, looking into mappings, lists and tuples up to ``depth``
    levels down (not into the objects found)."""
    if isinstance(x, kind):
        yield x  # type: ignore[misc]
    elif depth > 0 and isinstance(x, Mapping):
        for v in x.values():
            yield from instances(v, kind, depth - 1)
    elif depth > 0 and isinstance(x, (list, tuple)):
        for v in x:
            yield from instances(v, kind, depth - 1)
