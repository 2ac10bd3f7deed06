"""Numbers restored into a data position are checked before they are used.

A checkpoint's data state comes from a file: a crafted or damaged one must give a clear error at
``restore()`` (before training), never a silently different batch or a raw error at the first batch.
:func:`count` is the one check of a position, an epoch, an offset or a length: an integer (a bool, a
float, a string or a list is refused; NumPy integers and 0-d integer tensors are integers), at least
``lo``, at most ``hi`` when the dataset bounds it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any


def count(state: Mapping[str, Any], key: str, owner: str, *, lo: int = 0, hi: int | None = None) -> int:
    """``state[key]`` as an integer from ``lo`` to ``hi`` (inclusive), or a ``ValueError`` naming
    ``owner``, the key, the value and the range."""
    if not isinstance(state, Mapping):
        raise ValueError(f"the checkpoint's {owner} state is a {type(state).__name__}, not a mapping: it was not "
                         f"saved by this {owner}")
    if key not in state:
        raise ValueError(f"the checkpoint's {owner} state has no {key!r}: it was not saved by this {owner}")
    value = state[key]
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"the checkpoint's {owner} {key} is {value!r} ({type(value).__name__}), not an integer: "
                         "the checkpoint is damaged or was not written by unbroken") from None
    if number < lo or (hi is not None and number > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise ValueError(f"the checkpoint's {owner} {key} is {number}, outside {bound} (what this data allows): "
                         "the checkpoint is damaged or was not written for this data")
    return number
