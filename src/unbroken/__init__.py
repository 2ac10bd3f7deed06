"""unbroken: PyTorch training that survives interruption and resumes bitwise identically.

The public API::

    ckpt = unbroken.Checkpointer("runs/exp1", save_every=500, keep_last=3)   # or "s3://bucket/exp1"
    state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}
    ckpt.restore(state)              # newest valid checkpoint, or a fresh start
    while ckpt.progress.step < total_steps:
        ...one optimizer step...
        ckpt.step(state, loss=loss)  # saves when due

``save``/``load``/``verify`` work on a single checkpoint folder; ``Stateful`` is the
protocol user objects implement; ``Progress`` and ``Gradients`` are small helpers.
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    CorruptCheckpointError,
    EnvironmentMismatchError,
    InsufficientSpaceError,
    NewerFormatError,
    NoCheckpointError,
    NoValidCheckpointError,
    RunLockedError,
    StateMismatchError,
    StorageError,
    UnbrokenError,
    UnsupportedStateError,
)
from .state.stateful import Gradients, PerRank, Progress, Stateful  # noqa: E402
from .api import CheckpointInfo, PendingSave, load, save, verify  # noqa: E402
from .dist.comm import init_distributed  # noqa: E402
from .environment import EnvCheck  # noqa: E402
from .faults import Preemption  # noqa: E402
from .manager import Checkpointer  # noqa: E402
from .probe import probe_step  # noqa: E402
from .tiers import Remote  # noqa: E402

__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "PendingSave",
    "Remote",
    "Preemption",
    "EnvCheck",
    "Stateful",
    "Progress",
    "Gradients",
    "PerRank",
    "init_distributed",
    "save",
    "load",
    "verify",
    "probe_step",
    "UnbrokenError",
    "CorruptCheckpointError",
    "UnsupportedStateError",
    "StateMismatchError",
    "NoCheckpointError",
    "NoValidCheckpointError",
    "NewerFormatError",
    "RunLockedError",
    "InsufficientSpaceError",
    "EnvironmentMismatchError",
    "StorageError",
]
