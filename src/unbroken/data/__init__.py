"""Exact data resumption: the data position is a pure function of (seed, epoch, position).

- :class:`ResumableLoader` — a ``DataLoader`` for map-style datasets whose position
  restores in O(1), exactly, with any ``num_workers`` and any world size.
- :class:`SampleIndex` — what the dataset receives: an ``int`` with ``.generator()``
  for per-sample augmentation randomness keyed by (seed, epoch, index).
- :class:`GlobalOrder` — the shuffled order itself, for custom pipelines.
- :class:`JsonlReader`, :class:`Counted`, :class:`Skippable` — iterable/streaming data.
- :class:`StreamLoader` — a ``DataLoader`` for iterable data (``datasets.IterableDataset``,
  shuffle buffers included) resumed exactly at the sample, with ``num_workers``.
- :class:`Mixture` — several sources drawn by weight, weights changing by sample (curricula);
  sample ``g`` a pure function of (seed, g, schedule).
- :class:`Seeded` — a map-style dataset whose transforms draw from the global RNGs (a
  ``datasets`` ``set_transform``, torchvision), made exact: they are seeded per sample.
- :class:`CarryOver`, :class:`Packer`, :class:`Carrier` — collators that carry examples from
  batch to batch (packing, bucketing), saved with the data position.
"""

from .carry import Carrier, CarryOver, Packer
from .loader import ResumableLoader
from .mixture import Mixture
from .order import GlobalOrder
from .sample import SampleIndex, sample_seed
from .seeded import Seeded
from .stream import Counted, JsonlReader, Skippable
from .streaming import StreamLoader

__all__ = ["ResumableLoader", "GlobalOrder", "SampleIndex", "sample_seed", "JsonlReader", "Counted", "Skippable",
           "StreamLoader", "Mixture", "Seeded", "CarryOver", "Packer", "Carrier"]
