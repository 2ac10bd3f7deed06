"""``Checkpointer(accelerator, location)``: the one line after ``accelerator.prepare(...)``.

It reads what ``prepare`` registered (:func:`~.registered.collect`), opens an
:class:`unbroken.Checkpointer` on ``location`` and restores right away, before the loop draws a
batch. In the loop, :meth:`Checkpointer.step` after every batch is the step boundary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from accelerate import Accelerator

import unbroken

from .registered import collect


class Checkpointer:
    """Saves and restores everything ``accelerator.prepare`` registered, on every process.

    Create it after ``model, optimizer, loader, scheduler = accelerator.prepare(...)``, on every
    process. It restores at once (``resume``); then call :meth:`step` after the optimizer and
    scheduler calls of every batch.

    Args:
        accelerator: the ``accelerate.Accelerator`` the objects were prepared with.
        location: the run (a folder, ``s3://...``, any location :class:`unbroken.Checkpointer` takes).
        save_every: save every this many optimizer steps (from :meth:`step`).
        keep_last: committed checkpoints to keep (``None``: all).
        resume: ``True``: the newest valid checkpoint of the run, or a fresh start if it has none;
            a checkpoint (a folder or URL of this run): exactly that one; ``False``: a fresh start
            on purpose (later checkpoints win over the run's older ones: newest means committed last).
        eval_loaders: prepared ``DataLoader`` s that are iterated whole every time (evaluation):
            left out of checkpoints. Any other prepared ``DataLoader`` is refused (its position
            cannot be saved): train from a :class:`~.ResumableLoader`.
        **options: every other :class:`unbroken.Checkpointer` option (``trigger``, ``retention``,
            ``remote``, ``preemption``, ``env``, ``storage_options``, ``async_save``, ...).

    Raises :class:`unbroken.UnsupportedStateError` (before anything is restored) for what cannot
    resume exactly: a prepared ``DataLoader`` not in ``eval_loaders``, FSDP1, DeepSpeed or
    Megatron-LM through Accelerate, ``split_batches`` with a ``ResumableLoader``.
    """

    def __init__(self, accelerator: Accelerator, location: str | os.PathLike[str], *,
                 save_every: int | None = None, keep_last: int | None = 3,
                 resume: bool | str | os.PathLike[str] = True, eval_loaders: Iterable[Any] = (),
                 **options: Any) -> None:
        if not isinstance(accelerator, Accelerator):
            raise TypeError(f"Checkpointer() takes an accelerate.Accelerator, not {type(accelerator).__name__}")
        self.accelerator = accelerator
        self.state: dict[str, Any] = collect(accelerator, eval_loaders)
        """What is saved and restored, by name (``model``, ``optimizer``, ``data``, ...)."""
        self.checkpointer = unbroken.Checkpointer(location, save_every=save_every, keep_last=keep_last, **options)
        """The :class:`unbroken.Checkpointer` underneath (listing, tags, ``wait()``, events)."""
        self.restored: unbroken.CheckpointInfo | None = None
        """The checkpoint this process resumed from (``None``: a fresh start)."""
        try:
            if resume is True:
                self.restored = self.checkpointer.restore(self.state)
            elif resume is not False:
                self.restored = self.checkpointer.restore(self.state, path=resume)
        except BaseException:
            self.checkpointer.close()  # release the run: nothing was restored
            raise

    @property
    def progress(self) -> unbroken.Progress:
        """The loop counters: ``step`` (optimizer steps done), ``epoch``, ``samples``."""
        return self.checkpointer.progress

    def step(self, **metrics: Any) -> unbroken.CheckpointInfo | None:
        """Call after the optimizer/scheduler calls of every batch (metrics: the loss, ...).

        Between the micro-batches of an accumulation window (``accelerator.sync_gradients`` is
        false) nothing happens. After the micro-batch that stepped the optimizer, this is the step
        boundary: the step is counted, a save is made when due (every process saves the same
        step), and a preemption signal (SIGTERM, SIGUSR1, SIGINT) saves this step (with several
        processes: the next one, agreed during it) and exits with status 75 on every process.
        Returns what was saved, if anything.
        """
        if not self.accelerator.sync_gradients:
            return None
        return self.checkpointer.step(self.state, **metrics)

    def save(self, **metrics: Any) -> unbroken.CheckpointInfo | None:
        """Save now (at a step boundary: after :meth:`step`, not between micro-batches)."""
        if not self.accelerator.sync_gradients:
            raise RuntimeError("Checkpointer.save() between the micro-batches of an accumulation window: the "
                               "accumulated gradients are not saved; save after the micro-batch that steps")
        return self.checkpointer.save(self.state, metrics or None)

    def close(self) -> None:
        """Wait for background work (``async_save``, uploads) and release the run."""
        self.checkpointer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
