"""``Seeded``: per-sample global RNGs, for transforms that draw from them.

Augmentation written for unbroken draws from ``i.generator()`` (:class:`~unbroken.data.SampleIndex`).
Transforms written elsewhere draw from the global RNGs instead: a ``datasets`` ``set_transform``
/ ``with_transform``, torchvision transforms, ``random.random()``. In ``DataLoader`` workers those
streams depend on which worker loads which batch and how far it got, which a resume changes
(measured: 5 of 16 batches equal after a resume with 2 workers). ``Seeded(dataset)`` seeds
python's ``random``, numpy's global RNG and torch's CPU generator from ``(seed, epoch, index)``
before each sample is loaded, and puts them back after, so each sample gets the same draws with
any ``num_workers``, on any rank, after any resume; the training process's own streams are
untouched (also with ``num_workers=0``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .sample import SampleIndex, sample_seed


class Seeded(Dataset):
    """``dataset`` whose samples are loaded with the global RNGs seeded by ``(seed, epoch, index)``.

    Use it with :class:`~unbroken.data.ResumableLoader` (which passes the
    :class:`~unbroken.data.SampleIndex` that carries seed and epoch). Every sample is loaded on
    its own (``__getitems__`` is not forwarded), so a batched transform sees one sample at a time.
    Other attributes are the wrapped dataset's.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset" or name.startswith("__"):  # unpickling; and never the batched __getitems__
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int) -> Any:
        if not isinstance(index, SampleIndex):
            raise TypeError("Seeded needs the indices of an unbroken.data.ResumableLoader (a SampleIndex carries the "
                            f"seed and epoch of the draw), got {type(index).__name__}")
        seed = sample_seed(index.seed, index.epoch, int(index))
        saved = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        torch.default_generator.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.default_generator.set_state(saved[2])
