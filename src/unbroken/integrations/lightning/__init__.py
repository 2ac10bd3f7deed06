"""PyTorch Lightning integration: exact, pickle-free, preemption-safe checkpoints for ``Trainer``.

One line::

    from unbroken.integrations.lightning import UnbrokenCallback
    trainer = Trainer(..., callbacks=[UnbrokenCallback("runs/exp1", save_every=50)])
    trainer.fit(model)        # resumes from the newest valid checkpoint of runs/exp1, if any

Return an :class:`unbroken.data.ResumableLoader` from ``train_dataloader()`` for an exact,
O(1) mid-epoch data position. ``plugins=[UnbrokenCheckpointIO()]`` makes
``trainer.save_checkpoint`` and ``ckpt_path=`` go through unbroken too (see
:mod:`.checkpoint_io`). Works with ``lightning.pytorch`` and ``pytorch_lightning``
(``pip install 'unbroken[lightning]'``).
"""

from __future__ import annotations

from ._compat import available

if not available():
    raise ImportError(
        "unbroken.integrations.lightning needs PyTorch Lightning (lightning.pytorch or pytorch_lightning), "
        "which is not installed: pip install 'unbroken[lightning]'")

from .callback import UnbrokenCallback  # noqa: E402
from .checkpoint_io import UnbrokenCheckpointIO  # noqa: E402

__all__ = ["UnbrokenCallback", "UnbrokenCheckpointIO"]
