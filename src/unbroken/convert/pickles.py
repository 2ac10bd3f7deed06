"""Reading the pickle files other tools write (``torch.save``), without running their code.

Every source of ``unbroken import`` is a pickle: an HF Trainer's ``optimizer.pt``, a
Lightning ``.ckpt``, a ``torch.save`` file. They are read with ``torch.load(weights_only=True)``,
whose unpickler builds only tensors, containers and plain values and refuses every other
global. numpy arrays (RNG states) are allowed through the same allow-list the HF Trainer uses
(``numpy``'s array reconstructor, ``ndarray``, ``dtype``): data constructors, no code.

A reader may name more globals, each mapped to an inert *stand-in* of unbroken's own (never the
class the pickle names, so nothing of the tool that wrote it is imported or run): DeepSpeed's
optimizer files hold a loss-scaler object and a stage enum, read as a plain record of attributes
and as the enum's value (:mod:`unbroken.convert.deepspeed`).

A file that needs anything else is refused with :class:`UntrustedPickleError`, which names the
globals it would import, unless the caller passes ``trust=True`` (``--trust-pickle``): then
it is loaded with the full unpickler, which can run arbitrary code from the file.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UnbrokenError

log = logging.getLogger("unbroken")


class UntrustedPickleError(UnbrokenError):
    """A pickle needs globals that ``weights_only`` loading refuses (it could run code)."""


def _numpy_globals() -> list[Any]:
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_pickle(path: str | os.PathLike[str], trust: bool = False,
                stand_ins: Mapping[str, Callable[..., Any]] | None = None) -> Any:
    """The object in the ``torch.save`` file ``path``, on the CPU, loaded safely (see the module
    docstring); ``trust=True`` allows a file that the safe loader refuses. ``stand_ins`` maps a
    global's full name (``module.QualName``) to the inert callable or class built in its place."""
    path = Path(path)
    extra = [(obj, name) for name, obj in (stand_ins or {}).items()]
    try:
        with torch.serialization.safe_globals([*_numpy_globals(), *extra]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = [g for g in _unsafe_globals(path) if g not in (stand_ins or {})]
        if not trust:
            names = ", ".join(unsafe) if unsafe else str(e).splitlines()[0]
            raise UntrustedPickleError(
                f"{path} is a pickle that needs {names} to load; unpickling those can run code from the "
                "file, so it was not loaded (nothing in it ran). If you trust where the file came from, "
                "pass --trust-pickle (trust_pickle=True)") from None
        log.warning("loading %s with the full unpickler (--trust-pickle): it may run code; it needs %s",
                    path, ", ".join(unsafe) or "globals the safe loader refuses")
        return torch.load(path, map_location="cpu", weights_only=False)


def _unsafe_globals(path: Path) -> list[str]:
    """The globals the safe loader would refuse in ``path`` (found without unpickling)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - only for the message; the refusal stands either way
        return []
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _numpy_globals()}
    return sorted(g for g in found if g not in allowed)
