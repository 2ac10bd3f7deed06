"""``UnbrokenCallback``: the restore, the step boundary and the end of ``train()`` for one Trainer.

The callback events (``on_train_begin``: restore; ``on_step_end``: ``state.epoch``) and the
handlers of the four wrapped Trainer methods (see :mod:`unbroken.integrations.hf`).
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

import unbroken
from unbroken.data import ResumableLoader
from unbroken.dist.ddpalign import align_after_restore

from .counters import RankCounters, TrainerCounters
from .stacks import check_stack, training_state

log = logging.getLogger("unbroken")
_FRESH = object()  # resume_from_checkpoint=False: start fresh on purpose
WRAPPED = ("train", "get_train_dataloader", "get_batch_samples", "_run_epoch")
"""The Trainer methods :func:`~unbroken.integrations.hf.enable` wraps (on the instance); the
handler of ``name`` is ``UnbrokenCallback._<name without leading underscores>``."""


class UnbrokenCallback(TrainerCallback):
    """The callback :func:`enable` adds; it owns the :class:`unbroken.Checkpointer` of the run.

    ``checkpointer`` is the live Checkpointer (a new one per ``train()`` call), ``restored``
    the checkpoint the last ``train()`` resumed from (``None``: a fresh start), ``loader`` the
    :class:`~unbroken.data.ResumableLoader` that feeds the Trainer.
    """

    def __init__(self, trainer: Trainer, location: str | os.PathLike[str], options: dict[str, Any],
                 save_final: bool = True) -> None:
        check_stack(trainer)
        self.trainer = trainer
        self.location = os.fspath(location)
        self.options = options
        self.save_final = save_final
        self.checkpointer: unbroken.Checkpointer | None = unbroken.Checkpointer(self.location, **options)
        self.restored: unbroken.CheckpointInfo | None = None
        self.loader: ResumableLoader | None = None
        self.state: dict[str, Any] | None = None
        self._resume: Any = None
        self._guard: Any = None
        self._logged = 0

    # ------------------------------------------------------------------ wrapped methods
    def _train(self, original: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._resume = self._resume_target(resume_from_checkpoint)
        if self.checkpointer is None:
            self.checkpointer = unbroken.Checkpointer(self.location, **self.options)
        try:
            out = original(None, *args, **kwargs)
        except BaseException as e:
            self._end(e)
            raise
        self._end(None)
        return out

    def _get_train_dataloader(self, original: Any) -> ResumableLoader:
        dl = original()  # HF's own: its dataset (columns removed) and collator
        args = self.trainer.args
        workers = dl.num_workers
        extra: dict[str, Any] = {}
        if workers:
            extra.update(prefetch_factor=dl.prefetch_factor, persistent_workers=dl.persistent_workers,
                         worker_init_fn=dl.worker_init_fn, multiprocessing_context=dl.multiprocessing_context)
        self.loader = ResumableLoader(
            dl.dataset, batch_size=args.train_batch_size, **_order_of(self.trainer),
            shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
            drop_last=args.dataloader_drop_last, rank=args.process_index, world_size=max(1, args.world_size),
            collate_fn=dl.collate_fn, num_workers=workers, pin_memory=dl.pin_memory, **extra)
        self.loader.adopts_saved_order = True  # a run saved before the Trainer's order was kept goes on in its own
        return self.loader

    def _run_epoch(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original).bind(*args, **kwargs)
        a, loader = bound.arguments, self.loader
        if loader is None or self.state is None:  # not our training loop
            return original(*args, **kwargs)
        epoch = a["epoch"]
        finished = loader.position > 0 and loader.position >= loader.epoch_length
        if epoch < loader.epoch or (epoch == loader.epoch and finished):
            return None  # done before the checkpoint was taken
        if epoch > loader.epoch:  # HF moved on (a callback stopped the epoch early): so does the data
            sd = loader.state_dict()
            loader.load_state_dict({**sd, "epoch": epoch, "position": 0})
        elif loader.position:  # the epoch the checkpoint is in: HF runs what is left of it
            done = -(-loader.position // loader.global_batch)
            ga = self.trainer.args.gradient_accumulation_steps
            if done % ga:
                raise RuntimeError(f"unbroken: the restored data position ({done} batches into epoch {epoch}) is "
                                   f"not a whole number of optimizer steps of {ga} micro-batches; did "
                                   "gradient_accumulation_steps or the batch size change?")
            a["steps_in_epoch"] -= done
            a["num_update_steps_per_epoch"] -= done // ga
        out = original(*bound.args, **bound.kwargs)
        self._boundary()  # the epoch's (or training's) last step is complete only now
        return out

    def _get_batch_samples(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        self._boundary()  # the previous step is complete; nothing of this one has started
        return original(*args, **kwargs)

    # ------------------------------------------------------------------ callback events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t, ckpt = self.trainer, self.checkpointer
        if self.loader is None or ckpt is None:
            raise RuntimeError("unbroken: train() did not go through enable()'s wrappers")
        st = dict(training_state(t), data=self.loader, trainer=TrainerCounters(t),
                  trainer_rank=unbroken.PerRank(RankCounters(t)))
        if self._resume is _FRESH:  # on purpose: recorded, and the first save is not refused
            ckpt.start_fresh()
            self.restored = None
        elif self._resume is None:
            self.restored = ckpt.restore(st)
        else:
            self.restored = ckpt.restore(st, path=self._resume)
        if self.restored is not None:  # DDP (the wrapper, not in the state) reduces its first step as without
            align_after_restore({"model": t.model_wrapped})  # the restart (unbroken.dist.ddpalign)
        if state.global_step != ckpt.progress.step:
            raise RuntimeError(f"unbroken: the checkpoint's Trainer global_step ({state.global_step}) differs "
                               f"from its step ({ckpt.progress.step})")
        self._check_position(state)
        self.state = st
        self._logged = len(state.log_history)
        self._guard = ckpt.guard(st)
        self._guard.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self.loader
        if loader is not None and self.state is not None:
            # the same float HF computes, from the data position rather than from loop locals
            state.epoch = loader.epoch + -(-loader.position // loader.global_batch) / len(loader)

    # ------------------------------------------------------------------ internals
    def _boundary(self) -> None:
        """One optimizer step is complete: tell the Checkpointer (saves when due, preemption)."""
        ckpt, t = self.checkpointer, self.trainer
        if self.state is None or ckpt is None:
            return
        step = t.state.global_step
        if step == ckpt.progress.step:
            return
        if step != ckpt.progress.step + 1:
            raise RuntimeError(f"unbroken: the Trainer's global_step went from {ckpt.progress.step} to {step} "
                               "between two step boundaries")
        metrics = {}
        for entry in t.state.log_history[self._logged:]:
            metrics.update({k: v for k, v in entry.items() if k not in ("step", "epoch")
                            and isinstance(v, (int, float)) and not isinstance(v, bool)})
        self._logged = len(t.state.log_history)
        ckpt.step(self.state, **metrics)
        ending = step >= t.state.max_steps or t.control.should_training_stop
        if ending and self.save_final and (ckpt.last_saved is None or ckpt.last_saved.step != step):
            ckpt.save(self.state)

    def _end(self, exc: BaseException | None) -> None:
        """``train()`` returned or raised: the guard writes an emergency checkpoint for an
        exception (not for SystemExit: a preemption already saved), then the run is released."""
        guard, self._guard, self.state = self._guard, None, None
        ckpt, self.checkpointer = self.checkpointer, None
        try:
            if guard is not None:
                guard.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc else None)
        finally:
            if ckpt is not None:
                try:
                    ckpt.close()
                except Exception as err:
                    if exc is None:
                        raise
                    log.error("closing the run after a failed train() failed too: %s", err)

    def _resume_target(self, value: Any) -> Any:
        """``resume_from_checkpoint``: None/True = newest valid, False = fresh, a path = this run or
        one checkpoint (a folder with ``manifest.json``); an HF checkpoint is refused."""
        if value is None or value is True:
            return None
        if value is False:
            return _FRESH
        path = os.fspath(value)
        if "://" not in path and "://" not in self.location:
            if os.path.abspath(path) == os.path.abspath(self.location):
                return None
            if os.path.isfile(os.path.join(path, "trainer_state.json")) and \
                    not os.path.isfile(os.path.join(path, "manifest.json")):
                raise ValueError(f"{path} is a checkpoint of the Trainer's own checkpointing; with unbroken "
                                 f"enabled, resume_from_checkpoint takes the unbroken run ({self.location}) or "
                                 "one of its checkpoints")
        elif path.rstrip("/") == self.location.rstrip("/"):
            return None
        return path

    def _check_position(self, state: Any) -> None:
        """The data position should be where HF's counters say; it wins if not (and says so)."""
        loader, ga = self.loader, self.trainer.args.gradient_accumulation_steps
        assert loader is not None
        per_epoch = -(-len(loader) // ga)
        epoch, position = loader.epoch, -(-loader.position // loader.global_batch)
        if loader.position >= loader.epoch_length and loader.position > 0:
            epoch, position = epoch + 1, 0
        expected = (state.global_step // per_epoch, state.global_step % per_epoch * ga)
        if (epoch, position) != expected:
            log.warning("the restored data position (epoch %d, batch %d) is not where global_step %d puts it with "
                        "this batch size and gradient accumulation (epoch %d, batch %d): the data continues "
                        "from its own position", epoch, position, state.global_step, *expected)


def _order_of(trainer: Any) -> dict[str, Any]:
    """The order HF's own train loader has, so that enabling unbroken changes nothing of an uninterrupted run:
    Accelerate's ``SeedableRandomSampler`` (``accelerator_config.use_seedable_sampler``, the default) shuffles
    epoch ``e`` by ``torch.randperm`` seeded ``data_seed + e`` (``data_seed`` unset: the global RNG's initial
    seed, which the Trainer set to ``args.seed``); without it, torch's ``RandomSampler`` draws each epoch's
    seed from the global RNG (one process; with several, the default order). Either way the ``DataLoader``
    draws its workers' base seed from the global RNG at each epoch's start. (``accelerator_config`` may be a
    dict or a dataclass.)"""
    args = trainer.args
    config = getattr(args, "accelerator_config", None)
    seedable = config.get("use_seedable_sampler", True) if isinstance(config, dict) else \
        getattr(config, "use_seedable_sampler", True)
    if not seedable:  # torch's RandomSampler: one process only (with several, Accelerate syncs a generator
        # of its own, drawn when it prepares the loader: not reproduced, the default order is kept)
        return {"order": "dataloader" if args.world_size <= 1 else "unbroken", "seed": args.seed}
    seed = args.data_seed if args.data_seed is not None else torch.random.initial_seed()
    return {"order": "epoch_seeded", "seed": int(seed)}
