"""Which Lightning: ``lightning.pytorch`` (the unified package), ``pytorch_lightning``, or both.

Both are often installed side by side (``pip install lightning`` next to an older
``pytorch-lightning``). They are separate class trees: a ``pytorch_lightning.Trainer`` accepts a
``CheckpointIO`` plugin only if it is an instance of ``lightning_fabric``'s ``CheckpointIO``, and
``lightning.pytorch``'s Trainer only one of ``lightning.fabric``'s. The plugin and the callback are
built before the Trainer, so they cannot learn which one they will be given to: their classes
derive from the base class of *every* installed package (:func:`callback_bases`,
:func:`checkpoint_io_bases`), so either Trainer takes them. The two packages' base classes
declare the same hooks (no-ops) and abstract methods, so the order of the bases changes nothing.

Only these two fixed names are ever imported (plain ``import`` statements: the package never
imports a name it reads from data).
"""

from __future__ import annotations

import functools
from types import ModuleType

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _import(name: str) -> ModuleType | None:
    """The package ``name`` (one of :data:`PACKAGES`), or ``None`` if it cannot be imported."""
    try:
        if name == "lightning.pytorch":
            import lightning.pytorch

            return lightning.pytorch
        import pytorch_lightning

        return pytorch_lightning
    except ImportError:
        return None


@functools.cache
def installed() -> tuple[ModuleType, ...]:
    """The Lightning packages that can be imported (imported), in :data:`PACKAGES` order."""
    return tuple(p for p in map(_import, PACKAGES) if p is not None)


def fabric(pl: ModuleType) -> ModuleType:
    """The ``fabric`` package that goes with ``pl`` (where ``CheckpointIO`` lives)."""
    if pl.__name__ == "lightning.pytorch":
        import lightning.fabric

        return lightning.fabric
    import lightning_fabric

    return lightning_fabric


def callback_bases() -> tuple[type, ...]:
    """``Callback`` of every installed package: a class deriving from all of them is a callback to either Trainer."""
    return tuple(pl.callbacks.Callback for pl in installed())


def checkpoint_io_bases() -> tuple[type, ...]:
    """``CheckpointIO`` of every installed package (see :func:`callback_bases`)."""
    return tuple(fabric(pl).plugins.CheckpointIO for pl in installed())
