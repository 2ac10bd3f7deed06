"""RNG streams in ``unbroken diff``: each compared as a whole, and those nothing drew from shown apart.

A *stream* is the state of one random number generator: each of the global generators a
Checkpointer saves (its ``rng`` part: ``python``, ``numpy``, ``torch`` and ``cuda``, every device
as one stream) and every generator object in the state (``torch.Generator``, ``random.Random``,
numpy ``RandomState`` and ``Generator``), compared by their state, never by identity.

**The rule** (:func:`never_drawn`): a stream is *never drawn from* when its state is exactly
what seeding leaves before the first draw:

- Python's Mersenne Twister (``random``, ``random.Random``): first key word ``0x80000000``,
  position 624, no pending Gaussian. Python seeds its global generator from OS entropy when it
  starts, so a script that never seeds it and never draws from it has a different, never-drawn
  state in every process;
- numpy's legacy Mersenne Twister (``np.random``, ``RandomState``): first key word ``0x80000000``
  at position 623 (the state numpy seeds itself with from OS entropy at import), or exactly the
  state ``np.random.seed(k)`` gives, ``k`` its first key word (seeded with an integer); no pending
  Gaussian. (An array seed leaves position 624, which one 32-bit draw from the entropy state
  also reaches: not counted as never drawn.)
- a CUDA generator (``cuda``, or a ``torch.Generator`` on a CUDA device): Philox offset 0 (the
  last 8 bytes of its state) on every device.

Torch's CPU generator starts from a fixed seed, so an unseeded one is the same in every
process and needs no rule; numpy's ``Generator`` (PCG64 and others) cannot be told.

A stream that differs, never drawn from on both sides, cannot have shaped anything in either
checkpoint: it is listed apart and not counted as a difference. So is one present on one side
only and never drawn from there (CUDA states saved on a GPU machine that never drew from them,
against a checkpoint saved without CUDA). Every other difference counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..state.codec import StatefulValue

GLOBAL_RNG = "unbroken.state.rng.GlobalRNG"
"""The class recorded for the global generators a Checkpointer saves (its ``rng`` part)."""
NEVER = "never drawn"
DRAWN = "drawn"
ABSENT = "absent"
_MT_FIRST = 0x80000000  # the first key word of a Mersenne Twister seeded by init_by_array


@dataclass
class RngDiff:
    """An RNG stream that is not the same on both sides: what each side's state is (``never drawn``,
    ``drawn``, ``absent``, or ``""`` where it cannot be told) and whether the difference counts."""

    path: str
    a: str
    b: str
    counted: bool


def streams(x: Any) -> dict[str, tuple[str, Any]] | None:
    """The RNG streams ``x`` holds, as ``{name: (kind, state)}`` (name ``""`` for a generator object
    itself), or ``None`` if ``x`` is no generator."""
    if isinstance(x, StatefulValue) and x.cls == GLOBAL_RNG and isinstance(x.value, dict):
        kinds = {"python": "python", "numpy": "numpy", "torch": "torch", "cuda": "cuda"}
        return {k: (kinds.get(k, str(k)), v) for k, v in x.value.items()}
    if isinstance(x, torch.Generator):
        kind = "cuda" if x.device.type == "cuda" else "torch"
        return {"": (kind, {"device": str(x.device), "state": x.get_state()})}
    if isinstance(x, random.Random):
        return {"": ("python", x.getstate())}
    if isinstance(x, np.random.RandomState):
        return {"": ("numpy", x.get_state(legacy=False))}
    if isinstance(x, np.random.Generator):
        return {"": ("numpy.Generator", x.bit_generator.state)}
    return None


def never_drawn(kind: str, state: Any) -> bool | None:
    """Whether a stream of ``kind`` is in the state seeding leaves (see the module docstring);
    ``None`` where that cannot be told (torch's CPU generator, numpy's ``Generator``)."""
    try:
        if kind == "python":
            _, words, gauss = state
            return int(words[0]) == _MT_FIRST and int(words[624]) == 624 and gauss is None
        if kind == "numpy":
            key, pos = np.asarray(state["state"]["key"], dtype=np.uint32), int(state["state"]["pos"])
            if int(state["has_gauss"]) != 0:
                return False
            if int(key[0]) == _MT_FIRST and pos == 623:
                return True
            seeded = np.random.RandomState(int(key[0])).get_state(legacy=False)["state"]
            return pos == seeded["pos"] and np.array_equal(key, seeded["key"])
        if kind == "cuda":
            states = state["state"] if isinstance(state, dict) else state
            states = [states] if isinstance(states, torch.Tensor) else list(states)
            return all(_philox_offset(s) == 0 for s in states)
    except (TypeError, ValueError, KeyError, IndexError):
        return False  # not the layout of that generator: nothing says it was never drawn from
    return None


def _philox_offset(state: torch.Tensor) -> int:
    """The Philox offset of a CUDA generator's state: its last 8 bytes (after the 8-byte seed)."""
    raw = state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    if len(raw) < 16:
        raise ValueError("not a CUDA generator state")
    return int.from_bytes(raw[-8:], "little", signed=True)


def side(kind: str | None, state: Any) -> str:
    """One side of a stream for the report: ``absent`` (``kind`` None), ``never drawn``, ``drawn`` or ``""``."""
    if kind is None:
        return ABSENT
    found = never_drawn(kind, state)
    return "" if found is None else NEVER if found else DRAWN


def classify(path: str, a: tuple[str, Any] | None, b: tuple[str, Any] | None) -> RngDiff:
    """The :class:`RngDiff` of a stream that is not the same on both sides (``None``: absent there).
    It does not count when each side is never drawn from or absent."""
    sa, sb = side(*(a or (None, None))), side(*(b or (None, None)))
    return RngDiff(path, sa, sb, counted=not {sa, sb} <= {NEVER, ABSENT})
