"""The order and the global-RNG draws of torch's own samplers, for :class:`ResumableLoader`'s ``order=``.

A ``torch.utils.data.DataLoader`` without a ``generator`` draws from the global torch RNG every
time an iterator is created: one int64 for its workers' base seed, and, with ``shuffle=True``
(a ``RandomSampler`` without a generator), one more int64 that seeds that epoch's
``torch.randperm``. Those draws move every later random stream of the training loop (dropout,
augmentation), so a loader that draws nothing — :class:`ResumableLoader`'s default order — makes
an uninterrupted run differ from the same script with the framework's loader. The orders here
make the same draws at the same moment and the same permutation, and keep what they drew in the
loader's state, so that a resume draws nothing again:

- ``"dataloader"``: ``DataLoader(shuffle=...)`` as torch builds it (a single-process Accelerate
  loop, Lightning on one device): the epoch's permutation is seeded by the sampler's draw. For one
  process, as torch's loader is (each rank's own global RNG would shuffle its own way).
- ``"epoch_seeded"``: ``torch.randperm(n)`` seeded by ``seed + epoch`` — Accelerate's
  ``SeedableRandomSampler`` (the HF Trainer's sampler) — plus the ``DataLoader``'s base-seed draw;
  ranks take contiguous slices of each global batch, as Accelerate's ``BatchSamplerShard``.
- ``"distributed"``: ``DistributedSampler(shuffle=..., seed=seed)`` under a ``DataLoader``, as
  Lightning injects it with several devices: the same permutation, padded from its start to a
  multiple of the world size, and dealt to the ranks in turn (rank ``r`` takes positions ``r``,
  ``r + world_size``, ...), each rank's share batched by ``batch_size`` (a short last batch, or
  dropped with ``drop_last``).

Unlike the default order these hold a permutation of the dataset in memory (8 bytes a sample) and
compute it once per epoch and once per resume (``torch.randperm``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ORDERS = ("unbroken", "dataloader", "epoch_seeded", "distributed")


def _draw_int64() -> int:
    """One draw from the global torch RNG, exactly as ``DataLoader`` and ``RandomSampler`` make it."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class DrawnOrder:
    """Dataset indices and RNG draws of one of the torch orders (see the module docstring).

    Args:
        n: samples in the dataset.
        seed: ``"epoch_seeded"``: the sampler's seed (epoch ``e`` is ``randperm`` seeded ``seed + e``).
        shuffle: ``False``: dataset order; the base-seed draw is still made.
        mode: ``"dataloader"`` or ``"epoch_seeded"``.
        base_draw_each_epoch: ``False`` with persistent workers (the ``DataLoader`` keeps its
            iterator and draws the workers' base seed once).
    """

    def __init__(self, n: int, seed: int, shuffle: bool, mode: str, *, base_draw_each_epoch: bool = True) -> None:
        if mode not in ORDERS[1:]:
            raise ValueError(f"order must be one of {ORDERS}, not {mode!r}")
        self.n, self.seed, self.shuffle, self.mode = int(n), int(seed), bool(shuffle), mode
        self.base_draw_each_epoch = base_draw_each_epoch
        self.drawn_epoch: int | None = None  # the epoch whose draws are made
        self.rng: torch.Tensor | None = None  # the global RNG before this process's base-seed draw (not saved)
        self.sampler_seed: int | None = None
        self.started = False  # an iterator was created: with persistent workers, no base-seed draw after it
        self._perm: tuple[int, np.ndarray] | None = None

    def draw(self, epoch: int) -> None:
        """Make the draws a ``DataLoader`` makes when an iterator over ``epoch`` is created."""
        if self.base_draw_each_epoch or not self.started:
            self.rng = torch.get_rng_state()
            _draw_int64()  # the iterator's base seed (its workers'), as _BaseDataLoaderIter draws it
        self.sampler_seed = _draw_int64() if self.mode == "dataloader" and self.shuffle else None
        self.drawn_epoch, self.started, self._perm = int(epoch), True, None

    def worker_generator_state(self) -> torch.Tensor | None:
        """The state to give the inner ``DataLoader``'s generator: it then draws the base seed that
        the global RNG gave at this epoch's start, without touching the global RNG. ``None`` after a
        restore into this epoch: its workers' random streams cannot be the uninterrupted run's anyway
        (they had advanced; per-sample randomness is :class:`~unbroken.data.SampleIndex`'s job), so the
        snapshot, which differs from rank to rank, is not kept in the (replicated) loader state."""
        return self.rng

    def indices(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Dataset indices at positions ``[start, stop)`` of ``epoch`` (past ``n``: from the start again)."""
        if stop <= start or self.n == 0:
            return np.empty(0, dtype=np.int64)
        pos = np.arange(start, stop, dtype=np.int64) % self.n
        if not self.shuffle:
            return pos
        return self._permutation(epoch)[pos]

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            if self.mode in ("epoch_seeded", "distributed"):
                seed = self.seed + epoch
            elif self.drawn_epoch == epoch and self.sampler_seed is not None:
                seed = self.sampler_seed
            else:
                raise RuntimeError(f"the order of epoch {epoch} is drawn when its iterator starts")
            g = torch.Generator().manual_seed(seed)
            self._perm = (epoch, torch.randperm(self.n, generator=g).numpy())
        return self._perm[1]

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"order": self.mode, "drawn_epoch": -1 if self.drawn_epoch is None else self.drawn_epoch,
                               "started": self.started}
        if self.sampler_seed is not None:
            out["sampler_seed"] = self.sampler_seed
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        drawn = int(state.get("drawn_epoch", -1))
        self.drawn_epoch = None if drawn < 0 else drawn
        self.started = bool(state.get("started", False))
        self.rng = None
        seed = state.get("sampler_seed")
        self.sampler_seed = None if seed is None else int(seed)
        self._perm = None
