"""The Hugging Face ``transformers.Trainer``, saved and resumed by unbroken: one line.

::

    from unbroken.integrations.hf import enable

    trainer = Trainer(model=model, args=TrainingArguments(..., save_strategy="no"), train_dataset=ds)
    enable(trainer, "runs/exp1", save_every=50, keep_last=3)   # the one line
    trainer.train()       # resumes from the newest valid checkpoint of runs/exp1, or starts fresh

Checkpoints are unbroken's (atomic, verified, no pickle, retention, run index), SIGTERM /
SIGUSR1 / SIGINT save at the step boundary and exit 75 (:class:`unbroken.Preemption`), an
exception in a step leaves an exact emergency checkpoint (``ckpt.guard``), and a resumed
run computes bitwise what the uninterrupted run computes: parameters, AdamW moments, the LR
schedule, a ``GradScaler``, the RNGs, the data position, ``TrainerState`` (``global_step``,
``epoch``, ``total_flos``, ``num_input_tokens_seen``, ``log_history``, best metric), the
logged loss accumulators and ``ExportableState`` callbacks (``EarlyStoppingCallback``).

Design — why ``enable(trainer)`` and not a callback alone
---------------------------------------------------------
A ``TrainerCallback`` gets no reference to the Trainer, sees no exception, and runs after
the Trainer has already fixed its loop counters, so it cannot make a resume exact by
itself. ``enable`` adds a callback *and* wraps four methods **of this one Trainer
instance** (never the class, never a module global; nothing else is patched):

- ``get_train_dataloader`` (public): HF builds its DataLoader as usual (column removal,
  collator, worker settings); we keep its dataset and collator and return an
  :class:`unbroken.data.ResumableLoader` over them: the order of each epoch is a pure function
  of ``(seed, epoch, position)`` (``args.data_seed`` or ``args.seed``), so the data position
  restores in O(1) — no batch is replayed or skipped, unlike HF's ``skip_first_batches``.
  It owns a generator, so iterating draws nothing from the global RNG.
- ``_run_epoch`` (the Trainer's per-epoch loop): epochs finished before the checkpoint
  return at once; the epoch the checkpoint is in runs with ``steps_in_epoch`` and
  ``num_update_steps_per_epoch`` reduced by what was already done, so HF's own counters
  (which micro-batch syncs and steps the optimizer, the short last accumulation of an
  epoch) line up with the restored data position without replaying anything. The callback
  then sets ``state.epoch`` from the data position, to the same float HF computes.
- ``get_batch_samples`` (public; the first call of every optimizer step): **the step
  boundary**. Everything of the previous step is done — optimizer, scheduler, counters,
  logging, evaluation, HF's own save, epoch-end events — and nothing of the next one has
  started (no batch fetched, no collator or dropout randomness drawn). This is where
  ``Checkpointer.step`` runs: it saves when due and acts on a preemption signal. The last
  step of an epoch and of training reach their boundary when ``_run_epoch`` returns.
- ``train``: ``resume_from_checkpoint`` means this unbroken run (or one checkpoint folder
  of it), and an exception escaping the loop goes through ``Checkpointer.guard`` first
  (the emergency checkpoint), then propagates.

The restore itself happens in the callback's ``on_train_begin``: the first moment the
optimizer and scheduler exist. It runs before every other callback's.

What is saved: ``model`` (the unwrapped model), ``optimizer`` (the torch optimizer inside
accelerate's wrapper), ``scheduler``, ``scaler`` (accelerate's ``GradScaler``, with fp16),
``data`` (the ResumableLoader), ``trainer`` (:class:`TrainerCounters`), and the global RNGs.
Gradients are not: unbroken saves only at optimizer-step boundaries, where they are zero.

The Trainer's own checkpointing is left to you: ``save_strategy="no"`` is recommended (a
warning says so otherwise). Its checkpoints are still written if you keep it, unbroken never
reads them, and ``resume_from_checkpoint`` pointing at one is refused.

Needs ``transformers`` 5 (the ``Trainer._run_epoch`` loop); map-style datasets with
``train_sampling_strategy`` ``"random"`` or ``"sequential"``; no ``auto_find_batch_size``.
``eval_on_start`` evaluates again in every resumed process (as with HF alone), which draws
from the RNG, so it is warned about. Data parallel ranks get their slice of each global
batch from the ResumableLoader (``args.process_index`` / ``args.world_size``).

Several ranks: under ``torchrun`` the same line works with DDP, FSDP2 (``fsdp_config={"fsdp_version":
2}``) and DeepSpeed ZeRO (``TrainingArguments(deepspeed=...)``: the engine is saved through unbroken's
DeepSpeed adapter); FSDP1 is refused (:mod:`.stacks`). A Trainer built by another tool (LLaMA-Factory,
TRL) takes :class:`UnbrokenTrainerCallback` in its ``callbacks`` instead (:mod:`.attach`).

Modules: this one (:func:`enable`, the argument checks), :mod:`.callback`
(:class:`UnbrokenCallback`: restore, step boundary, end of ``train()``), :mod:`.counters`
(:class:`TrainerCounters`, :class:`RankCounters`), :mod:`.stacks` (the state of each training
stack), :mod:`.attach` (:class:`UnbrokenTrainerCallback`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

try:
    import transformers
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("unbroken.integrations.hf needs transformers and accelerate: "
                      "pip install -e '.[hf]' in unbroken's folder") from e

import torch

from .attach import UnbrokenTrainerCallback
from .callback import WRAPPED, UnbrokenCallback
from .counters import TrainerCounters

__all__ = ["enable", "UnbrokenTrainerCallback", "UnbrokenCallback", "TrainerCounters"]


def enable(trainer: Trainer, location: str | os.PathLike[str], *, save_every: int | None = None,
           keep_last: int | None = 3, save_final: bool = True, **checkpointer_options: Any) -> UnbrokenCallback:
    """Make ``trainer`` save to and resume from the unbroken run ``location`` (see the module docstring).

    ``save_every``, ``keep_last`` and every other keyword (``trigger``, ``retention``, ``remote``,
    ``preemption``, ``async_save``, ``env``, ...) go to :class:`unbroken.Checkpointer`, which is
    created here (a bad location raises before any training). ``save_final`` also saves when
    training ends. Returns the callback (``.checkpointer``, ``.restored``).
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(f"enable() takes a transformers.Trainer, not {type(trainer).__name__}")
    missing = [m for m in WRAPPED if not callable(getattr(trainer, m, None))]
    if missing:
        raise RuntimeError(f"unbroken.integrations.hf needs transformers 5 (Trainer.{missing[0]} is missing in "
                           f"transformers {transformers.__version__})")
    if any(isinstance(cb, UnbrokenCallback) for cb in trainer.callback_handler.callbacks):
        raise RuntimeError("unbroken is already enabled on this Trainer")
    _check_args(trainer)
    cb = UnbrokenCallback(trainer, location, dict(checkpointer_options, save_every=save_every, keep_last=keep_last),
                          save_final)
    trainer.callback_handler.callbacks.insert(0, cb)  # restores before any other callback looks at the state
    for name in WRAPPED:
        setattr(trainer, name, _wrap(getattr(trainer, name), getattr(cb, "_" + name.lstrip("_"))))
    return cb


def _wrap(original: Any, handler: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return handler(original, *args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__doc__ = original.__doc__
    return wrapper


def _check_args(trainer: Trainer) -> None:
    args = trainer.args
    if args.auto_find_batch_size:
        raise ValueError("unbroken.integrations.hf does not support auto_find_batch_size (the batch size, and "
                         "with it the data position, would change between attempts); set the batch size")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        raise ValueError(f"train_sampling_strategy={strategy!r} is not supported by unbroken.integrations.hf "
                         "(its order is not a function of the position); use 'random' or 'sequential'")
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        raise ValueError("unbroken.integrations.hf needs a map-style train_dataset (with __len__ and __getitem__)")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
        warnings.warn(f"the Trainer's own checkpoints (save_strategy={args.save_strategy!s}) are still written "
                      "(pickled optimizer and RNG); unbroken neither needs nor reads them: "
                      "TrainingArguments(save_strategy='no')", stacklevel=3)
    if args.eval_on_start:
        warnings.warn("eval_on_start evaluates again in every resumed process, which draws from the RNG: the "
                      "resumed run is then not bitwise the uninterrupted one", stacklevel=3)
