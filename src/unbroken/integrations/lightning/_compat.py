"""Which Lightning: ``lightning.pytorch`` (the unified package) or ``pytorch_lightning``.

Both may be installed; their ``Trainer`` accepts only its own ``Callback`` and ``CheckpointIO``
subclasses. The integration's classes pick the package at construction: the one the program
has already imported (its ``Trainer`` comes from there), ``lightning.pytorch`` when both or
neither are imported yet.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or set to None
        return False


def available() -> list[str]:
    """The Lightning packages that can be imported, preferred first."""
    return [name for name in PACKAGES if _importable(name)]


def pick() -> ModuleType:
    """The Lightning package the program uses (see the module docstring)."""
    names = available()
    if not names:
        raise ImportError("PyTorch Lightning is not installed: pip install 'unbroken[lightning]'")
    imported = [n for n in names if sys.modules.get(n) is not None]
    return importlib.import_module((imported or names)[0])


def fabric_io(pl: ModuleType) -> ModuleType:
    """The ``fabric`` package that goes with ``pl`` (where ``CheckpointIO`` lives)."""
    return importlib.import_module("lightning.fabric" if pl.__name__ == "lightning.pytorch" else "lightning_fabric")
