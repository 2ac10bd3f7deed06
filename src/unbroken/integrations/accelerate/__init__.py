"""Hugging Face Accelerate, saved and resumed by unbroken: one line after ``accelerator.prepare``.

::

    from unbroken.integrations.accelerate import Checkpointer, ResumableLoader

    loader = ResumableLoader(train_set, batch_size=16, seed=0)        # instead of DataLoader(..., shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ckpt = Checkpointer(accelerator, "runs/exp1", save_every=500)     # the one line: restores now
    while ckpt.progress.step < max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                ...; optimizer.step(); scheduler.step(); optimizer.zero_grad()
            ckpt.step(loss=loss)                                       # the step boundary

Everything ``prepare`` registered is saved and restored, on every process: the models
(unwrapped; FSDP2's DTensors through DCP, resharded at load), the torch optimizers and LR
schedulers inside Accelerate's wrappers, the ``GradScaler``, ``register_for_checkpointing``
objects, ``accelerator.step`` (the accumulation window), the data position of each
:class:`ResumableLoader`, and every rank's RNGs. Checkpoints are unbroken's (atomic, verified,
no pickle); SIGTERM saves the step and exits 75 on every rank; a run of 2 processes resumes on 1.

Modules: :mod:`.checkpointer` (:class:`Checkpointer`), :mod:`.loader` (:class:`ResumableLoader`),
:mod:`.registered` (what ``prepare`` registered, what is refused and why).
"""

from __future__ import annotations

try:
    import accelerate  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("unbroken.integrations.accelerate needs accelerate: "
                      "pip install -e '.[accelerate]' in unbroken's folder") from e

from .checkpointer import Checkpointer
from .loader import ResumableLoader

__all__ = ["Checkpointer", "ResumableLoader"]
