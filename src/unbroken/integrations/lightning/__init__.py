"""PyTorch Lightning integration: exact, pickle-free, preemption-safe checkpoints for ``Trainer``.

One line::

    from unbroken.integrations.lightning import UnbrokenCallback
    trainer = Trainer(..., callbacks=[UnbrokenCallback("runs/exp1", save_every=50)])
    trainer.fit(model)        # resumes from the newest valid checkpoint of runs/exp1, if any

Return an :class:`unbroken.data.ResumableLoader` from ``train_dataloader()`` for an exact,
O(1) mid-epoch data position. ``plugins=[UnbrokenCheckpointIO()]`` makes
``trainer.save_checkpoint`` and ``ckpt_path=`` go through unbroken too (see
:mod:`.checkpoint_io`). Works with ``lightning.pytorch`` and ``pytorch_lightning``, either or both
installed (``pip install -e '.[lightning]'``), and with ``enable_checkpointing`` on or off:
unbroken does not need Lightning's ``ModelCheckpoint``.
"""

from __future__ import annotations

from ._compat import installed

if not installed():
    raise ImportError(
        "unbroken.integrations.lightning needs PyTorch Lightning (lightning.pytorch or pytorch_lightning), "
        "which is not installed: pip install -e '.[lightning]' in unbroken's folder")

from .callback import UnbrokenCallback
from .checkpoint_io import UnbrokenCheckpointIO

__all__ = ["UnbrokenCallback", "UnbrokenCheckpointIO"]
