"""The epoch boundary: what ``Checkpointer.epochs``, ``batches`` and ``end_epoch`` do.

An epoch is its batches (the optimizer steps, each ending in ``ckpt.step()``) and then its
epoch-end work (evaluation, ``scheduler.step()``, LR annealing, early stopping). Two moments
separate one epoch from the next, and a checkpoint resumes exactly at each:

1. **The batch loop ends**: ``for batch in loader`` asks the :class:`~unbroken.data.ResumableLoader`
   for a batch after the last one, or the source of :func:`batches` runs out. The data moves to
   the next epoch (``progress.epoch`` + 1). A checkpoint taken before that moment — at the epoch's
   last step — is *inside* the epoch: resumed, the batch loop serves nothing and ends at once,
   and the loop goes on with that epoch's epoch-end work. Nothing is skipped.
2. **The epoch ends** (:meth:`EpochLoop.close`, from ``ckpt.end_epoch()``, which ``ckpt.epochs()``
   calls when the body of an epoch returns): the loop moves to the next epoch. If the batch loop
   ended early (``break``, a dry run) or there is none, the data moves on here; every
   ``ResumableLoader`` of the state starts the new epoch. Then the epoch-end triggers
   (``AtEpochEnd``, ``OnImprovement``) save this instant, and a preemption signal that arrived
   during the epoch-end work is honoured: saved here, exit 75. The resumed run starts the next
   epoch; the epoch-end work is neither skipped nor done twice.

Between the two moments the user's epoch-end work runs, and unbroken saves nothing there by
itself: a SIGTERM during an evaluation waits for the end of the epoch (a signal handler only sets
a flag, and the evaluation is the user's code); a process killed there resumes from its last
checkpoint and runs the epoch-end work once, from its beginning. A checkpoint the user saves there
explicitly (``ckpt.save()`` after the batch loop) resumes at the next epoch: what the epoch-end
work did before it is in the checkpoint, what remained after it is skipped. Save at the end of the
epoch instead (``end_epoch`` with a trigger).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader

from ..data.loader import ResumableLoader
from ..events import Event, Restored, Started
from ..state.stateful import Progress
from .restoring import sync_data_position


class EpochLoop:
    """The epoch the training loop is in, kept beside ``progress.epoch`` (the epoch the data is
    in): set when a run starts or resumes, moved on by :meth:`close` (see the module docstring)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.epoch = progress.epoch

    def on_event(self, event: Event) -> None:
        if isinstance(event, (Restored, Started)):
            self.epoch = self.progress.epoch

    def close(self, state: Mapping[str, Any]) -> None:
        """The epoch the loop is in ends now: moment 2 of the module docstring, counters only."""
        p = self.progress
        sync_data_position(p, state)  # a ResumableLoader whose batch loop ended is in the next epoch already
        if p.epoch <= self.epoch:  # the batch loop ended early, or there is none: the data moves on here
            p.epoch, p.batch = self.epoch + 1, 0
        for value in state.values():
            if isinstance(value, ResumableLoader) and value.epoch < p.epoch:
                value.set_epoch(p.epoch)
        self.epoch = p.epoch

    def epochs(self, close: Callable[[], Any], epochs: int | Sequence[Any]) -> Iterator[Any]:
        """The items of ``epochs`` from the epoch the loop is in; ``close()`` after each body that
        did not end its epoch itself. Checked now, not at the first ``next()``."""
        return self._epochs(close, _sequence(epochs))

    def _epochs(self, close: Callable[[], Any], seq: Sequence[Any]) -> Iterator[Any]:
        while self.epoch < len(seq):
            current = self.epoch
            yield seq[current]
            if self.epoch == current:  # the body did not call ckpt.end_epoch() itself
                close()


def _sequence(epochs: int | Sequence[Any]) -> Sequence[Any]:
    if isinstance(epochs, bool) or not isinstance(epochs, (int, Sequence)) or isinstance(epochs, (str, bytes)):
        raise TypeError(f"epochs() takes a number of epochs or a sequence such as range(1, n + 1), "
                        f"not {type(epochs).__name__}")
    if isinstance(epochs, int):
        if epochs < 0:
            raise ValueError(f"the number of epochs must not be negative, not {epochs}")
        return range(epochs)
    return epochs


def batches(progress: Progress, iterable: Iterable[Any]) -> Iterator[Any]:
    """The items of ``iterable`` (one epoch's batches) not handed out before a resume: the first
    ``progress.batch`` are skipped (read and dropped), each item handed out is counted, and when
    ``iterable`` runs out the data moves to the next epoch (moment 1 of the module docstring)."""
    if isinstance(iterable, ResumableLoader):
        return iter(iterable)  # it keeps its own position
    if isinstance(iterable, DataLoader):
        raise TypeError("ckpt.batches() cannot resume a DataLoader exactly: its iterator draws from the global "
                        "RNG, and skipping would load every skipped batch. Use unbroken.data.ResumableLoader "
                        "(put it in the state, iterate it directly)")
    return _counted(progress, iter(iterable))


def _counted(progress: Progress, it: Iterator[Any]) -> Iterator[Any]:
    if progress.batch:
        collections.deque(itertools.islice(it, progress.batch), maxlen=0)  # handed out before the resume
    for item in it:
        progress.batch += 1
        yield item
    progress.epoch, progress.batch = progress.epoch + 1, 0
