"""``UnbrokenTrainerCallback``: unbroken for a ``Trainer`` you do not construct, as one callback.

LLaMA-Factory, TRL and other tools build the ``transformers.Trainer`` themselves and pass
through only a list of callbacks::

    from llamafactory.train.tuner import run_exp
    from unbroken.integrations.hf import UnbrokenTrainerCallback

    run_exp(args, callbacks=[UnbrokenTrainerCallback("runs/sft", save_every=50)])   # the one line

    trainer = SFTTrainer(model=..., args=..., train_dataset=...,                   # TRL
                         callbacks=[UnbrokenTrainerCallback("runs/sft", save_every=50)])

A callback alone cannot make a resume exact (see :mod:`unbroken.integrations.hf`), so this
one does nothing by itself but find its Trainer: at ``on_init_end`` — the end of
``Trainer.__init__`` — it looks up the call stack for the Trainer whose callback list holds
it, and calls :func:`~unbroken.integrations.hf.enable` on that Trainer with its arguments.
From then on the Trainer behaves exactly as with ``enable(trainer, ...)``.

The one difference is ``resume_from_checkpoint``: here ``train()`` is called by the tool,
which may pass a checkpoint of the Trainer's own checkpointing (LLaMA-Factory passes
``output_dir``'s last ``checkpoint-N`` when ``overwrite_output_dir`` is false). unbroken's
run governs: a value that is not this run or one of its checkpoints is ignored with a
warning, and training resumes from the newest valid checkpoint of the run (``True``,
``False``, the run and its checkpoints mean what they mean for ``enable``).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

from transformers import Trainer, TrainerCallback

import unbroken

from .callback import UnbrokenCallback


class UnbrokenTrainerCallback(TrainerCallback):
    """Pass it in a Trainer's ``callbacks``: the Trainer saves to and resumes from the unbroken run ``location``.

    Takes the arguments of :func:`~unbroken.integrations.hf.enable` except the Trainer:
    ``save_every``, ``keep_last``, ``save_final`` and every :class:`unbroken.Checkpointer`
    option (``trigger``, ``retention``, ``remote``, ``preemption``, ``async_save``,
    ``incremental``, ``env``, ``storage_options``, ...). Use one per Trainer, passed to its
    constructor (``Trainer(callbacks=[...])``, ``run_exp(callbacks=[...])``): added later
    with ``trainer.add_callback`` it is too late, and ``train()`` says so; with the Trainer
    in hand, ``enable(trainer, ...)`` is the same thing.

    ``trainer`` is the Trainer it attached to, ``checkpointer`` the live
    :class:`unbroken.Checkpointer` (during ``train()``), ``restored`` the checkpoint the last
    ``train()`` resumed from (``None``: a fresh start).
    """

    def __init__(self, location: str | os.PathLike[str], *, save_every: int | None = None,
                 keep_last: int | None = 3, save_final: bool = True, **checkpointer_options: Any) -> None:
        self.location = os.fspath(location)
        self.trainer: Trainer | None = None
        self._options = dict(checkpointer_options, save_every=save_every, keep_last=keep_last,
                             save_final=save_final)
        self._callback: UnbrokenCallback | None = None

    @property
    def checkpointer(self) -> unbroken.Checkpointer | None:
        return None if self._callback is None else self._callback.checkpointer

    @property
    def restored(self) -> unbroken.CheckpointInfo | None:
        return None if self._callback is None else self._callback.restored

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._find_trainer()
        if self.trainer is trainer:
            return  # enable() inserted its callback before this one: the handler's loop calls us again
        if self.trainer is not None:
            raise RuntimeError("this UnbrokenTrainerCallback is already attached to another Trainer; "
                               "create one per Trainer (each with its own run location)")
        from . import enable  # the package imports this module first

        callback = enable(trainer, self.location, **self._options)  # raises from Trainer(...) if it refuses
        _govern_resume(trainer, self.location)
        self.trainer, self._callback = trainer, callback

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._callback is None:
            raise RuntimeError("UnbrokenTrainerCallback was not attached: it must be among the callbacks the "
                               "Trainer is constructed with (Trainer(callbacks=[...]), run_exp(args, "
                               "callbacks=[...])); for a Trainer you already have, call "
                               "unbroken.integrations.hf.enable(trainer, location, ...) before train()")

    def _find_trainer(self) -> Trainer:
        """The Trainer whose ``__init__`` is running this event: the nearest caller frame whose
        ``self`` is a Trainer holding this very callback."""
        frame = inspect.currentframe()
        try:
            while frame is not None:
                owner = frame.f_locals.get("self")
                if isinstance(owner, Trainer) and any(
                        cb is self for cb in getattr(getattr(owner, "callback_handler", None), "callbacks", ())):
                    return owner
                frame = frame.f_back
        finally:
            del frame
        raise RuntimeError("UnbrokenTrainerCallback could not find the transformers.Trainer that owns it (its "
                           "on_init_end was not called from Trainer.__init__ with this callback in its list); "
                           "pass it in Trainer(callbacks=[...]), or call unbroken.integrations.hf.enable(trainer, "
                           "location, ...) on the Trainer")


def _govern_resume(trainer: Trainer, location: str) -> None:
    """Wrap ``trainer.train`` (this instance) so that a ``resume_from_checkpoint`` outside the
    unbroken run (the tool's guess, e.g. ``output_dir/checkpoint-500``) is ignored: the run governs."""
    train = trainer.train

    def governed_train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and not _inside(resume_from_checkpoint, location):
            warnings.warn(f"resume_from_checkpoint={os.fspath(resume_from_checkpoint)!r} is not a checkpoint of the "
                          f"unbroken run {location}: ignored, training resumes from the run's newest valid "
                          "checkpoint (turn the Trainer's own checkpoints off: save_strategy='no')", stacklevel=2)
            resume_from_checkpoint = None
        return train(resume_from_checkpoint, *args, **kwargs)

    governed_train.__wrapped__ = train  # type: ignore[attr-defined]
    governed_train.__doc__ = train.__doc__
    trainer.train = governed_train  # type: ignore[method-assign]


def _inside(path: str | os.PathLike[str], location: str) -> bool:
    """Whether ``path`` is the run ``location`` or something in it (a checkpoint folder)."""
    p = os.fspath(path)
    if "://" in p or "://" in location:
        p, run = p.rstrip("/"), location.rstrip("/")
    else:
        p, run = os.path.realpath(p), os.path.realpath(location)
    return p == run or p.startswith(run.rstrip("/") + "/")
