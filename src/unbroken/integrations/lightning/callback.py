"""``UnbrokenCallback``: a Lightning ``Trainer`` saves and resumes through an unbroken run.

It is a plain Lightning ``Callback`` (not a ``Checkpoint``), of whichever Lightning the Trainer
comes from (:mod:`._compat`): ``Trainer(enable_checkpointing=False)`` takes it, and it needs none
of Lightning's own checkpointing; with ``enable_checkpointing=True`` (Lightning's default) Lightning
adds its default ``ModelCheckpoint`` as it does without unbroken, which saves its own ``.ckpt`` at
each epoch end, beside unbroken's checkpoints.

What it does, hook by hook (the Trainer's order):

- ``setup("fit")``: opens the run (:class:`unbroken.Checkpointer`) and moves this callback to the end
  of ``trainer.callbacks`` (as Lightning does with its ``Checkpoint`` callbacks): at every hook it
  runs after the others, so a checkpoint holds what they did at that batch, and a preemption exit
  comes after their ``on_train_batch_end``.
- ``on_fit_start`` (optimizers and schedulers exist, the fit loop has not started): builds the
  state — the LightningModule, every optimizer and LR scheduler, the fit loop's counters
  (``global_step``, epoch, batch index, accumulation phase; with a
  :class:`~unbroken.data.ResumableLoader` also its data position, which Lightning keeps with
  the loop), the other callbacks' state, the precision plugin's scaler, a stateful
  datamodule — and restores the newest valid checkpoint into it. The global RNGs (python,
  numpy, torch, CUDA, per rank) come back with it.
- ``on_train_start`` (the train dataloader and its iterator exist): the restored RNG states
  are set again — creating a DataLoader iterator draws from the global torch RNG, and
  Lightning creates it between ``on_fit_start`` and here — so the first resumed step draws
  exactly what the uninterrupted run drew. Lightning's SIGTERM handler is replaced by
  unbroken's, which acts at the next optimizer step (below) instead of stopping mid-step with
  exit status 0. The step guard starts (``Checkpointer.guard``).
- ``on_train_batch_end`` after a batch that stepped the optimizer (``global_step`` moved): one
  ``Checkpointer.step``: saves every ``save_every`` steps (atomic, verified, pickle-free),
  applies retention, and after a SIGTERM/SIGUSR1/SIGINT saves and exits with status 75.
  Lightning's own checkpoints are taken at this hook too, so its loop restores the counters
  exactly as for a ``ModelCheckpoint(every_n_train_steps=...)`` checkpoint, with the
  optimizer, scheduler, data position and RNG all of that instant.
- ``on_exception``: an exception inside a step gives the exact emergency checkpoint of
  :meth:`unbroken.Checkpointer.guard` (the state at the start of the failed optimizer step).
- ``on_train_end``: a final checkpoint (unless the last step is saved: a fit that reaches ``max_steps``
  saves that step at ``on_train_batch_end``, with the loop's state of that instant, so that a fit
  resumed with a larger ``max_steps`` continues in the same epoch), then the run is closed.

Several ranks (Lightning's launcher with ``devices=N``, torchrun, SLURM): the same callback on every rank.
The model and optimizer part of the state follows the strategy (:mod:`.strategies`: replicated under
DDP, DTensors under ``ModelParallelStrategy``, sharded rows under FSDP1, the DeepSpeed engine); the
ranks agree on every save and on a preemption signal, so a SIGTERM to any one rank (with Lightning's
launcher, to the process the user started) makes every rank save the same step and exit 75.

Validation inside ``fit`` runs with the RNG states forked (``isolate_validation_rng``):
Lightning skips the validation due at a step that was checkpointed when it resumes from that
checkpoint, so validation must not move the training's random streams.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ... import Checkpointer
from ...data import ResumableLoader
from ...dist.ddpalign import align_after_restore
from ._compat import callback_bases
from .strategies import between_micro_batches, model_state

log = logging.getLogger("unbroken")


class _Loops:
    """The Trainer's loop counters and the data position Lightning keeps with them (``Stateful``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {"fit_loop": t.fit_loop.state_dict(), "validate_loop": t.validate_loop.state_dict(),
                "test_loop": t.test_loop.state_dict(), "predict_loop": t.predict_loop.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        fit = dict(state["fit_loop"])
        # Lightning's restored fit loop ends an epoch whose last batch was done by itself and then
        # iterates the loader for the next one: a ResumableLoader restored there starts that epoch
        # (rather than serving an empty rest of the old one, for a loop of the user's own)
        own = fit.get("state_dict")  # the fit loop's own state: {"combined_loader": [loader states]}
        if isinstance(own, Mapping) and isinstance(own.get("combined_loader"), list):
            fit["state_dict"] = dict(own, combined_loader=[dict(s, epoch_ended=True) if _resumable_state(s) else s
                                                           for s in own["combined_loader"]])
        self.trainer.fit_loop.load_state_dict(fit)


def _resumable_state(s: Any) -> bool:
    return isinstance(s, Mapping) and {"epoch", "position", "samples_seen", "seed", "n"} <= set(s)


class _Callbacks:
    """The state of the Trainer's other callbacks, by ``state_key`` (``Stateful``)."""

    def __init__(self, trainer: Any, owner: Any) -> None:
        self.trainer, self.owner = trainer, owner

    def _others(self) -> list[Any]:
        return [cb for cb in self.trainer.callbacks if cb is not self.owner]

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for cb in self._others():
            sd = cb.state_dict()
            if sd:
                out[cb.state_key] = sd
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for cb in self._others():
            if cb.state_key in state:
                cb.load_state_dict(state[cb.state_key])


class _Plain:
    """An object whose ``state_dict`` may be empty (a precision plugin, a datamodule) as ``Stateful``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict() or {}

    def load_state_dict(self, state: Any) -> None:
        if state:
            self.obj.load_state_dict(state)


def _rng_now() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng(saved: Mapping[str, Any]) -> None:
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved:
        torch.cuda.set_rng_state_all(saved["cuda"])


def _loaders(obj: Any) -> list[Any]:
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in _loaders(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _loaders(v)]
    return [obj]


class UnbrokenCallback(*callback_bases()):  # type: ignore[misc]  # a Callback of each installed Lightning
    """Checkpoint a Lightning ``Trainer`` with unbroken: ``callbacks=[UnbrokenCallback("runs/exp1", save_every=50)]``.

    Args:
        location: the run (a folder or a URL, as for :class:`unbroken.Checkpointer`).
        save_every: save every this many optimizer steps (``trainer.global_step``).
        keep_last: committed checkpoints to keep.
        resume: restore the newest valid checkpoint of ``location`` at the start of ``fit``.
        isolate_validation_rng: run validation inside ``fit`` with the RNG states forked (see
            the module docstring); turn off only if no save can coincide with a validation.
        **options: any other :class:`unbroken.Checkpointer` option (``trigger``, ``retention``,
            ``remote``, ``preemption``, ``async_save``, ``env``, ``probe``, ...).

    ``checkpointer`` is the open :class:`unbroken.Checkpointer` during ``fit``; ``restored``
    what the last ``fit`` resumed from (``None``: a fresh start). A ``Trainer`` imported from
    ``lightning.pytorch`` or from ``pytorch_lightning`` takes it, with ``enable_checkpointing``
    ``True`` or ``False``: unbroken needs none of Lightning's own checkpointing. ``False`` turns
    off Lightning's default ``ModelCheckpoint`` (a pickled ``.ckpt`` at each epoch end).
    """

    def __init__(self, location: Any, *, save_every: int | None = None, keep_last: int | None = 3,
                 resume: bool = True, isolate_validation_rng: bool = True, **options: Any) -> None:
        self.location, self.save_every, self.keep_last = location, save_every, keep_last
        self.resume, self.isolate_validation_rng, self.options = resume, isolate_validation_rng, options
        self.checkpointer: Checkpointer | None = None
        self.restored: Any = None
        self.state: dict[str, Any] | None = None
        self._guard: Any = None
        self._entered = False
        self._rng: dict[str, Any] | None = None
        self._val_rng: dict[str, Any] | None = None
        self._unbroken_sigterm: Any = None
        self._global_step = 0

    @property
    def state_key(self) -> str:
        return "UnbrokenCallback"

    # ------------------------------------------------------------------ fit
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        # last at every hook, after the callbacks that act at the same batch (see the module docstring);
        # a new list: Lightning goes on with the list it is iterating
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.location, save_every=self.save_every, keep_last=self.keep_last,
                                             **self.options)

    def build_state(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        """The state unbroken saves and restores for this Trainer (see the module docstring)."""
        state = model_state(trainer, pl_module)  # per strategy: DDP, FSDP1, FSDP2, DeepSpeed (strategies.py)
        scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
        for i, sched in enumerate(scheds):
            state["scheduler" if len(scheds) == 1 else f"scheduler_{i}"] = sched
        state["loops"] = _Loops(trainer)
        state["callbacks"] = _Callbacks(trainer, self)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler):
            state["scaler"] = scaler
        else:
            state["precision"] = _Plain(trainer.precision_plugin)
        dm = trainer.datamodule
        if dm is not None:
            state["datamodule"] = _Plain(dm)
        return state

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.checkpointer is None:
            self.setup(trainer, pl_module, "fit")
        ckpt = self.checkpointer
        assert ckpt is not None
        self.state = self.build_state(trainer, pl_module)
        self.restored, self._rng = None, None
        explicit = trainer.ckpt_path
        mine = self._mine(explicit)
        if self.resume and mine is None:
            log.warning("fit(ckpt_path=%s): not resuming from %s; Lightning restores that checkpoint (without "
                        "the RNG states, so the resumed run is not exact)", explicit, ckpt.location)
        elif self.resume:
            self.restored = ckpt.restore(self.state, path=None if mine == "run" else mine)
            if self.restored is not None:
                # DDP (the strategy's wrapper, not in the state) reduces its first step as without the restart
                align_after_restore({"model": trainer.strategy.model})  # (unbroken.dist.ddpalign)
                self._rng = _rng_now()  # set again once the dataloader iterator exists (on_train_start)
        self._guard = ckpt.guard(self.state)  # opens the run and installs unbroken's signal handlers
        self._global_step = trainer.global_step
        if threading.current_thread() is threading.main_thread():
            # unbroken's handler; Lightning installs its own over it before training starts
            self._unbroken_sigterm = signal.getsignal(signal.SIGTERM)

    def _mine(self, path: Any) -> str | None:
        """``"run"`` if ``fit(ckpt_path=)`` is absent or this run, the checkpoint's path if it is one of
        this run's checkpoints, else ``None`` (someone else's checkpoint: Lightning restores it)."""
        import os

        if path is None:
            return "run"
        p, run = str(path).rstrip("/"), str(self.location).rstrip("/")
        if "://" not in p and "://" not in run:
            p, run = os.path.abspath(p), os.path.abspath(run)
        if p == run:
            return "run"
        return p if p.rsplit("/", 1)[0] == run else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._rng is not None:
            _set_rng(self._rng)
            self._rng = None
        self._check_data(trainer)
        self._take_sigterm()
        assert self.checkpointer is not None and self.state is not None
        self._global_step = trainer.global_step
        if self._guard is not None:
            self._guard.__enter__()
            self._entered = True

    def _take_sigterm(self) -> None:
        """Lightning's SIGTERM handler stops training at the end of the current *batch* (mid-accumulation
        possibly) with ``SIGTERMException``, exit status 0. Give SIGTERM back to unbroken's handler
        (which chains to the one before Lightning's): the run stops at the next optimizer step, saved,
        with status 75. Lightning's teardown puts back the handler it found, unbroken's."""
        ckpt = self.checkpointer
        if (threading.current_thread() is not threading.main_thread() or ckpt is None
                or signal.SIGTERM not in tuple(ckpt.preemption.signals)):
            return
        current = signal.getsignal(signal.SIGTERM)
        if type(current).__name__ == "_HandlersCompose" and callable(self._unbroken_sigterm):
            signal.signal(signal.SIGTERM, self._unbroken_sigterm)

    def _check_data(self, trainer: Any) -> None:
        try:
            loaders = _loaders(trainer.train_dataloader)
        except Exception:  # noqa: BLE001 - only a diagnosis
            return
        plain = [type(dl).__name__ for dl in loaders if dl is not None and not isinstance(dl, ResumableLoader)
                 and not (hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict"))]
        if plain:
            warnings.warn(
                f"the train dataloader ({', '.join(plain)}) cannot save its position: a resumed fit restarts the "
                "epoch's data (other batches, other order) and is not exact. Return an "
                "unbroken.data.ResumableLoader from train_dataloader() for an exact O(1) resume.", stacklevel=2)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._global_step or between_micro_batches(trainer):
            return  # accumulating: no optimizer step in this batch
        self._global_step = step
        ckpt = self.checkpointer
        assert ckpt is not None and self.state is not None
        ckpt.progress.step = step - 1  # Checkpointer.step counts it to `step`: checkpoints are named by global_step
        ckpt.progress.epoch = trainer.current_epoch
        samples = [dl.samples_seen for dl in _loaders(trainer.train_dataloader) if isinstance(dl, ResumableLoader)]
        if len(samples) == 1:
            ckpt.progress.samples = samples[0]
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        metrics = {"loss": loss} if isinstance(loss, torch.Tensor) and loss.numel() == 1 else {}
        ckpt.step(self.state, **metrics)  # saves when due; after a signal: saves and exits 75
        if 0 < trainer.max_steps <= step and not self._saved(step):
            # the last step is saved here, at its batch's end: by on_train_end Lightning has closed the epoch,
            # and a fit resumed from there with a larger max_steps would number its epochs one higher
            ckpt.save(self.state)

    def _saved(self, step: int) -> bool:
        """Whether ``step``'s checkpoint is committed (an ``async_save`` in flight is waited for)."""
        assert self.checkpointer is not None
        self.checkpointer.flush()
        last = self.checkpointer.last_saved
        return last is not None and last.step == step

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.isolate_validation_rng and not trainer.sanity_checking:
            self._val_rng = _rng_now()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._val_rng is not None:
            _set_rng(self._val_rng)
            self._val_rng = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        ckpt = self.checkpointer
        if ckpt is None or self.state is None:
            return
        self._leave_guard(None)
        if trainer.global_step and not self._saved(trainer.global_step):
            ckpt.progress.step, ckpt.progress.epoch = trainer.global_step, trainer.current_epoch
            ckpt.save(self.state)
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self._leave_guard(exception)  # the exact emergency checkpoint (not for SystemExit)
        finally:
            self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _leave_guard(self, exc: BaseException | None) -> None:
        guard, entered, self._guard, self._entered = self._guard, self._entered, None, False
        if guard is not None and entered:
            guard.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc else None)

    def _close(self) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        self.state = None
        if ckpt is not None:
            ckpt.close()

