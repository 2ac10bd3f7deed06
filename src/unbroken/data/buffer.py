"""A shuffle buffer whose contents and random generator are part of the saved state.

The algorithm is the one of ``datasets`` 5 (``BufferShuffledExamplesIterable``): examples
fill the buffer up to ``size``; then the buffer is permuted, all but ``size // 2`` are
released, and the rest stay to mix with the next examples; at the end of the stream what is
left is permuted and released. The generator of epoch ``e`` is derived as ``datasets`` derives
it (``set_epoch``), so over one reader (``num_workers=0``) the order is the one ``datasets``
gives, and it is the same after any resume: the examples held, the generator's state and the
released examples not yet batched are saved (plain values and tensors, no pickle).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .checked import count


def epoch_generator(generator: np.random.Generator, epoch: int) -> np.random.Generator:
    """The buffer's generator in ``epoch``: ``datasets``' ``shift_rngs`` rule (a copy at epoch 0)."""
    g = copy.deepcopy(generator)
    if epoch == 0:
        return g
    return np.random.default_rng(int(g.integers(0, 1 << 63)) - epoch)


class ShuffleBuffer:
    """Holds up to ``size`` examples; :meth:`push` returns the ones it releases, in order."""

    def __init__(self, size: int, generator: np.random.Generator) -> None:
        if size < 1:
            raise ValueError("a shuffle buffer needs size >= 1")
        self.size = size
        self.rng = generator
        self.items: list[Any] = []

    def push(self, item: Any) -> list[Any]:
        self.items.append(item)
        if len(self.items) < self.size:
            return []
        perm = self.rng.permutation(len(self.items))
        keep = self.size // 2
        cut = len(self.items) - keep
        out = [self.items[i] for i in perm[:cut]]
        self.items = [self.items[i] for i in perm[cut:]]
        return out

    def drain(self) -> list[Any]:
        """The rest, shuffled, at the end of the stream (the buffer is then empty)."""
        if not self.items:
            return []
        perm = self.rng.permutation(len(self.items))
        out = [self.items[i] for i in perm]
        self.items = []
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "items": list(self.items), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if count(state, "size", "shuffle buffer", lo=1) != self.size:
            raise ValueError(f"the checkpoint's shuffle buffer holds {state['size']} examples, this one {self.size}: "
                             "keep buffer_size across a resume")
        if not isinstance(state.get("items"), (list, tuple)) or len(state["items"]) > self.size:
            raise ValueError(f"the checkpoint's shuffle buffer items are not a list of at most {self.size} examples: "
                             "the checkpoint is damaged or was not written by this buffer")
        self.items = list(state["items"])
        self.rng.bit_generator.state = state["rng"]
