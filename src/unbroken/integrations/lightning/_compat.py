"""Which Lightning: ``lightning.pytorch`` (the unified package) or ``pytorch_lightning``.

Both may be installed; their ``Trainer`` accepts only its own ``Callback`` and ``CheckpointIO``
subclasses. The integration's classes pick the package at construction: the one the program
has already imported (its ``Trainer`` comes from there), else ``lightning.pytorch`` if it can
be imported, else ``pytorch_lightning``. Only these two fixed names are ever imported (plain
``import`` statements: the package never imports a name it reads from data).
"""

from __future__ import annotations

import sys
from types import ModuleType

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _import(name: str) -> ModuleType | None:
    """The package ``name`` (one of :data:`PACKAGES`), or ``None`` if it cannot be imported."""
    try:
        if name == "lightning.pytorch":
            import lightning.pytorch as package
        else:
            import pytorch_lightning as package
    except ImportError:
        return None
    return package


def available() -> list[str]:
    """The Lightning packages that can be imported, preferred first (the importable ones are imported)."""
    return [name for name in PACKAGES if (sys.modules[name] is not None if name in sys.modules else _import(name))]


def pick() -> ModuleType:
    """The Lightning package the program uses (see the module docstring)."""
    imported = [n for n in PACKAGES if sys.modules.get(n) is not None]
    for name in [*imported, *PACKAGES]:
        package = _import(name)
        if package is not None:
            return package
    raise ImportError("PyTorch Lightning is not installed: pip install 'unbroken[lightning]'")


def fabric_io(pl: ModuleType) -> ModuleType:
    """The ``fabric`` package that goes with ``pl`` (where ``CheckpointIO`` lives)."""
    if pl.__name__ == "lightning.pytorch":
        import lightning.fabric as fabric
    else:
        import lightning_fabric as fabric
    return fabric
