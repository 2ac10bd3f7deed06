"""Per-sample randomness that does not depend on workers, batch size or resumes.

The loader hands the dataset a :class:`SampleIndex`: an ``int`` (so ``data[i]``
works unchanged) that also knows the seed and epoch it was drawn in. Augmentation
draws from ``i.generator()`` (torch) or ``i.numpy()`` (numpy), seeded by
(seed, epoch, index): the same sample gets the same augmentation with 0, 2 or 4
workers, on any rank, before and after any resume, and a different one next epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .order import mix_ints


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for the randomness of sample ``index`` in ``epoch``."""
    return mix_ints(seed, epoch, index, 0x5A3D) >> 1


class SampleIndex(int):
    """A dataset index that carries the seed and epoch of the draw."""

    seed: int
    epoch: int

    def __new__(cls, index: int, seed: int, epoch: int) -> SampleIndex:
        self = super().__new__(cls, index)
        self.seed = seed
        self.epoch = epoch
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # crosses to DataLoader workers
        return (SampleIndex, (int(self), self.seed, self.epoch))

    def generator(self) -> torch.Generator:
        """A fresh torch CPU generator for this sample's augmentation."""
        return torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, int(self)))

    def numpy(self) -> np.random.Generator:
        """A fresh numpy generator for this sample's augmentation."""
        return np.random.default_rng(sample_seed(self.seed, self.epoch, int(self)))

    def __repr__(self) -> str:
        return f"SampleIndex({int(self)}, seed={self.seed}, epoch={self.epoch})"
