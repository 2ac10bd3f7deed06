"""Exact data resumption: the data position is a pure function of (seed, epoch, position).

- :class:`ResumableLoader` — a ``DataLoader`` for map-style datasets whose position
  restores in O(1), exactly, with any ``num_workers`` and any world size.
- :class:`SampleIndex` — what the dataset receives: an ``int`` with ``.generator()``
  for per-sample augmentation randomness keyed by (seed, epoch, index).
- :class:`GlobalOrder` — the shuffled order itself, for custom pipelines.
- :class:`JsonlReader`, :class:`Counted`, :class:`Skippable` — iterable/streaming data.
"""

from .loader import ResumableLoader
from .order import GlobalOrder
from .sample import SampleIndex, sample_seed
from .stream import Counted, JsonlReader, Skippable

__all__ = ["ResumableLoader", "GlobalOrder", "SampleIndex", "sample_seed", "JsonlReader", "Counted", "Skippable"]
