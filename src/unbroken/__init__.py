"""unbroken: PyTorch training that survives interruption and resumes bitwise identically.

The public API::

    ckpt = unbroken.Checkpointer("runs/exp1", save_every=500, keep_last=3)   # or "s3://bucket/exp1"
    state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}
    ckpt.restore(state)              # newest valid checkpoint, or a fresh start
    while ckpt.progress.step < total_steps:
        ...one optimizer step...
        ckpt.step(state, loss=loss)  # saves when due

``save``/``load``/``verify`` work on a single checkpoint folder; ``Stateful`` is the
protocol user objects implement; ``Progress``, ``Vars`` (plain loop variables, restored in
place) and ``Gradients`` are small helpers.

Importing the package imports nothing else (no torch): each public name is imported from its
module on first use (PEP 562), so ``import unbroken.cli`` starts in a fraction of a second.
``from unbroken import Checkpointer`` and ``unbroken.Checkpointer`` work as usual, and so does
``unbroken.data`` (or any other subpackage) without importing it first.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported for real
    from .api import CheckpointInfo, PendingSave, load, save, verify
    from .checkpointer.environment import EnvCheck
    from .checkpointer.manager import Checkpointer
    from .checkpointer.probe import probe_step
    from .dist.comm import init_distributed
    from .errors import (
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
    from .faults import Preemption
    from .state.stateful import Gradients, PerRank, Progress, Stateful, Vars
    from .tiers.ram import RamTier
    from .tiers.remote import Remote

_WHERE: dict[str, str] = {
    # name -> the module (relative to this package) that defines it
    **dict.fromkeys(("CheckpointInfo", "PendingSave", "load", "save", "verify"), ".api"),
    "init_distributed": ".dist.comm",
    "EnvCheck": ".checkpointer.environment",
    **dict.fromkeys(("CorruptCheckpointError", "EnvironmentMismatchError", "InsufficientSpaceError",
                     "NewerFormatError", "NoCheckpointError", "NoValidCheckpointError", "RunLockedError",
                     "StateMismatchError", "StorageError", "UnbrokenError", "UnsupportedStateError"), ".errors"),
    "Preemption": ".faults",
    "Checkpointer": ".checkpointer.manager",
    "probe_step": ".checkpointer.probe",
    **dict.fromkeys(("Gradients", "PerRank", "Progress", "Stateful", "Vars"), ".state.stateful"),
    "Remote": ".tiers.remote",
    "RamTier": ".tiers.ram",
}

__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "PendingSave",
    "Remote",
    "RamTier",
    "Preemption",
    "EnvCheck",
    "Stateful",
    "Progress",
    "Vars",
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


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then cached in the package); or a
    subpackage (``unbroken.data``) not imported yet."""
    where = _WHERE.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where, __name__), name)
    elif name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
