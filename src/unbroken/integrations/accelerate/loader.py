"""``ResumableLoader`` for Accelerate: unbroken's exact data order, accepted by ``accelerator.prepare``.

It is :class:`unbroken.data.ResumableLoader` (the order of an epoch is a pure function of
``(seed, epoch, global position)``, a resume is O(1), each rank takes its slice of every global
batch, another world size continues at the same global sample) plus what Accelerate's own
prepared loader (``DataLoaderShard``) does for a training loop:

- **registration**: it is a ``torch.utils.data.DataLoader`` already marked as prepared, so
  ``accelerator.prepare(model, optimizer, loader, scheduler)`` registers it on the Accelerator
  (``accelerator._dataloaders``, where :class:`~unbroken.integrations.accelerate.Checkpointer`
  finds it) and returns it unchanged: Accelerate does not re-shard it;
- **device placement**: each batch goes to the Accelerator's device (``accelerate.utils.send_to_device``);
- **the end of the epoch**: it is Accelerate's active dataloader while it is iterated
  (``DataLoaderStateMixin``) and says so *before* handing out the epoch's last batch, so
  ``accelerator.accumulate`` (``sync_with_dataloader``, the default) steps the optimizer on it and
  restarts the accumulation window, as with a prepared ``DataLoader``.

An epoch whose last batch was consumed by a checkpointed step is still under way until the loop
over it ends: after a resume from such a checkpoint, the first iteration yields nothing (the
code after the loop, an evaluation, runs once, as in the uninterrupted run) and the next one
starts the next epoch.

Not done, on purpose: Accelerate's per-epoch RNG synchronisation (``rng_types``) — the order
needs no RNG and every rank's RNGs are checkpointed per rank; a resume mid-epoch would add a
synchronisation the uninterrupted run did not have.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState, PartialState
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, Dataset

from unbroken.data import ResumableLoader as _CoreLoader

AUTO = "auto"


class ResumableLoader(_CoreLoader, DataLoader, DataLoaderStateMixin):  # type: ignore[misc]
    """An :class:`unbroken.data.ResumableLoader` that ``accelerator.prepare`` accepts (see the module docstring).

    The arguments are :class:`unbroken.data.ResumableLoader`'s (``batch_size`` is per process: a
    micro-batch with gradient accumulation; rank and world size default to ``torch.distributed``'s),
    and one more:

    Args:
        device: where batches go: ``"auto"`` (the Accelerator's device, once one exists), a
            device, or ``None`` (leave them where the collate function put them).
    """

    _is_accelerate_prepared = True  # accelerator.prepare registers it as it is

    def __init__(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
                 drop_last: bool = False, continuous: bool = False, rank: int | None = None,
                 world_size: int | None = None, device: torch.device | str | None = AUTO,
                 **loader_kwargs: Any) -> None:
        _CoreLoader.__init__(self, dataset, batch_size, shuffle, seed=seed, drop_last=drop_last,
                             continuous=continuous, rank=rank, world_size=world_size, **loader_kwargs)
        # DataLoader.__init__ is not called: the DataLoader that iterates is the one inside
        # (``self._loader``); DataLoader attributes this object lacks are read from it.
        self.device = device

    def __getattr__(self, name: str) -> Any:
        if name == "_loader":  # not created yet (inside __init__)
            raise AttributeError(name)
        return getattr(self._loader, name)

    # ------------------------------------------------------------------ what Accelerate reads
    @property
    def total_batch_size(self) -> int:
        """Samples per global batch (Accelerate's name for it)."""
        return self.global_batch

    @property
    def gradient_state(self) -> GradientState:
        """Accelerate's shared gradient state (looked up when iterating: creating a loader touches nothing)."""
        return GradientState()

    @property
    def _drop_last(self) -> bool:
        return self.drop_last

    def _target(self) -> torch.device | None:
        if isinstance(self.device, str) and self.device == AUTO:
            return PartialState().device if PartialState._shared_state else None
        return None if self.device is None else torch.device(self.device)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not a _BaseDataLoaderIter
        if 0 < self.position >= self.epoch_length:
            # restored from a checkpoint of the epoch's last step: that epoch's loop ends here
            self.load_state_dict({**self.state_dict(), "epoch": self.epoch + 1, "position": 0})
            return
        device = self._target()
        self.begin()  # Accelerate's active dataloader (GradientState), end_of_dataloader reset
        try:
            for batch in _CoreLoader.__iter__(self):
                self.end_of_dataloader = self.position >= self.epoch_length
                yield send_to_device(batch, device) if device is not None else batch
        finally:
            self.end()
