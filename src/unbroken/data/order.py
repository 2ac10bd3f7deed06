"""The global sample order as a pure function of (seed, epoch, position).

``GlobalOrder(n, seed).indices(epoch, start, stop)`` returns the dataset indices at
positions ``start..stop`` of that epoch's shuffled order in time proportional to
``stop - start`` and memory independent of ``n``: there is no permutation array to
build or walk. The shuffle is a keyed Feistel network over the smallest even power
of two ≥ n, with cycle-walking to stay inside ``[0, n)`` (the standard construction
of a pseudo-random permutation on an arbitrary domain, as in format-preserving
encryption). So resuming at sample 10^9 costs what resuming at sample 10 costs, and
a dataset of 10^10 samples needs no 80 GB ``randperm``.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized: a fast, well-mixing bijection on uint64."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _mix64_int(x: int) -> int:
    """:func:`mix64` on one Python int (much faster than numpy for scalars)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_ints(*values: int) -> int:
    """A 64-bit hash of a tuple of integers (seeds of per-epoch and per-sample streams)."""
    h = 0x243F6A8885A308D3
    for v in values:
        h = _mix64_int(h ^ ((v * _GOLDEN) & _MASK64))
    return h


class GlobalOrder:
    """Dataset indices for each (epoch, position): shuffled per epoch, or in order.

    Args:
        n: number of samples in the dataset.
        seed: the shuffle seed; the same seed gives the same order on every machine.
        shuffle: ``False`` gives ``0, 1, ..., n-1`` every epoch.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True) -> None:
        if n < 0:
            raise ValueError("n must be non-negative")
        self.n, self.seed, self.shuffle = int(n), int(seed), shuffle
        bits = max(2, (max(n, 2) - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._cached_epoch: int | None = None
        self._cached_keys: list[np.uint64] = []

    def _keys(self, epoch: int) -> list[np.uint64]:
        if self._cached_epoch != epoch:  # the key schedule is per epoch: compute it once
            self._cached_keys = [np.uint64(mix_ints(self.seed, epoch, r)) for r in range(_ROUNDS)]
            self._cached_epoch = epoch
        return self._cached_keys

    def _encrypt(self, x: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in keys:
            left, right = right, left ^ (mix64(right ^ k) & self._mask)
        return (left << self._half) | right

    def indices(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Dataset indices at positions ``[start, stop)`` of ``epoch`` (int64 array).

        Positions past ``n`` wrap around to the start of the same epoch's order
        (used to pad the last global batch).
        """
        if stop <= start or self.n == 0:
            return np.empty(0, dtype=np.int64)
        pos = np.arange(start, stop, dtype=np.uint64) % np.uint64(self.n)
        if not self.shuffle:
            return pos.astype(np.int64)
        keys = self._keys(epoch)
        with np.errstate(over="ignore"):
            out = self._encrypt(pos, keys)
            outside = out >= np.uint64(self.n)
            while outside.any():  # cycle-walking: < 4 rounds expected, the domain is < 4n
                out[outside] = self._encrypt(out[outside], keys)
                outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def __call__(self, epoch: int, position: int) -> int:
        """The dataset index at one position."""
        return int(self.indices(epoch, position, position + 1)[0])
