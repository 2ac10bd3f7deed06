"""The process-global random number generators, captured and restored as one unit.

Covered: python ``random``, numpy's legacy global generator, torch CPU, and every
CUDA device when CUDA is available. Restore this *last*, after everything else in
the state has been loaded, so that nothing the restore does (building optimizer
state, creating tensors) draws from a generator after it was set.

A saved state comes from a file that anyone may have written, so it is checked in full
before any generator is touched (:meth:`GlobalRNG.check`): types, lengths and ranges of
every field, and each state is set on a scratch generator first. A bad state raises
:class:`~unbroken.errors.CorruptCheckpointError` naming the field, and no generator has
changed; call ``GlobalRNG.check(state)`` before restoring anything else to keep the whole
restore all-or-nothing.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, StateMismatchError
from .codec import StatefulValue

_MT_WORDS = 624  # Mersenne Twister state words (python random and numpy MT19937)
_STATE_MAX = 1 << 20  # bytes: a CPU generator state is 5056, a CUDA one 16


def _bad(field: str, msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"RNG state {field}: {msg}")


def _show(x: Any) -> str:
    text = f"{type(x).__name__} {x!r}" if not isinstance(x, (torch.Tensor, np.ndarray)) else \
        f"{type(x).__name__} of {x.dtype} {tuple(x.shape)}"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(x: Any) -> bool:
    return (type(x) is int or isinstance(x, np.integer)) and not isinstance(x, (bool, np.bool_))


def python_state(py: Any, where: str = "'python'") -> tuple[int, tuple[int, ...], float | None]:
    """``random.getstate()``: ``(3, 625 ints, gauss_next)``, checked, as the exact tuple to set
    (``random.setstate`` itself accepts any ``gauss_next``, and ``gauss()`` then fails)."""
    if not isinstance(py, (tuple, list)) or len(py) != 3:
        raise _bad(where, f"expected (version, internal state, gauss_next), got {_show(py)}")
    version, internal, gauss = py
    if not _is_int(version) or version != 3:
        raise _bad(f"{where}[0]", f"unsupported version {_show(version)} (expected 3)")
    if not isinstance(internal, (tuple, list)) or len(internal) != _MT_WORDS + 1:
        raise _bad(f"{where}[1]", f"expected {_MT_WORDS + 1} integers, got {_show(internal)}")
    words = tuple(internal)
    for i, w in enumerate(words):
        top = 2**32 if i < _MT_WORDS else _MT_WORDS + 1
        if not _is_int(w) or not 0 <= w < top:
            raise _bad(f"{where}[1][{i}]", f"expected an integer in [0, {top}), got {_show(w)}")
    if gauss is not None and type(gauss) is not float:
        raise _bad(f"{where}[2]", f"expected None or a float, got {_show(gauss)}")
    return 3, tuple(int(w) for w in words), gauss


def _numpy_state(npst: Any) -> dict[str, Any]:
    """``np.random.get_state(legacy=False)`` (or the legacy 5-tuple), as a dict to set."""
    if isinstance(npst, (tuple, list)):
        if len(npst) != 5:
            raise _bad("'numpy'", f"expected the 5-tuple of np.random.get_state(), got {_show(npst)}")
        npst = {"bit_generator": npst[0], "state": {"key": npst[1], "pos": npst[2]},
                "has_gauss": npst[3], "gauss": npst[4]}
    if not isinstance(npst, dict):
        raise _bad("'numpy'", f"expected the dict of np.random.get_state(legacy=False), got {_show(npst)}")
    for k in ("bit_generator", "state", "has_gauss", "gauss"):
        if k not in npst:
            raise _bad(f"'numpy'[{k!r}]", "missing")
    if type(npst["bit_generator"]) is not str or npst["bit_generator"] != "MT19937":
        raise _bad("'numpy'['bit_generator']", f"expected 'MT19937', got {_show(npst['bit_generator'])}")
    inner = npst["state"]
    if not isinstance(inner, dict) or "key" not in inner or "pos" not in inner:
        raise _bad("'numpy'['state']", f"expected a dict of 'key' and 'pos', got {_show(inner)}")
    key, pos = inner["key"], inner["pos"]
    if isinstance(key, (list, tuple)):
        if len(key) != _MT_WORDS or not all(_is_int(w) and 0 <= w < 2**32 for w in key):
            raise _bad("'numpy'['state']['key']", f"expected {_MT_WORDS} 32-bit words, got {_show(key)}")
        key = np.array([int(w) for w in key], dtype=np.uint32)
    elif not (isinstance(key, np.ndarray) and key.dtype == np.uint32 and key.shape == (_MT_WORDS,)):
        raise _bad("'numpy'['state']['key']", f"expected {_MT_WORDS} uint32 words, got {_show(key)}")
    if not _is_int(pos) or not 0 <= pos <= _MT_WORDS:
        raise _bad("'numpy'['state']['pos']", f"expected an integer in [0, {_MT_WORDS}], got {_show(pos)}")
    has_gauss, gauss = npst["has_gauss"], npst["gauss"]
    if not _is_int(has_gauss) or has_gauss not in (0, 1):
        raise _bad("'numpy'['has_gauss']", f"expected 0 or 1, got {_show(has_gauss)}")
    if not isinstance(gauss, (float, np.floating)):
        raise _bad("'numpy'['gauss']", f"expected a float, got {_show(gauss)}")
    if not (int(key[0]) & 0x80000000) and not key[1:].any():
        raise _bad("'numpy'['state']['key']", "the all-zero key of a generator that only draws zeros "
                   "(numpy's normal draws then never return)")
    return {"bit_generator": "MT19937", "state": {"key": key, "pos": int(pos)},
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _byte_state(t: Any, field: str, size: int | None) -> torch.Tensor:
    """A generator state: a 1-D uint8 tensor; of ``size`` bytes, the size of this process's
    generator, when given (another size is a :class:`StateMismatchError`: another build)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise _bad(field, f"expected a 1-D uint8 tensor, got {_show(t)}")
    if t.numel() > _STATE_MAX:
        raise _bad(field, f"{t.numel()} bytes is no generator state")
    if size is not None and t.numel() != size:
        raise StateMismatchError(f"RNG state {field}: {t.numel()} bytes, but this process's generator "
                                 f"has {size} (saved by another build of torch?)")
    return t.detach().cpu()


def _cuda_states(cuda: Any) -> list[torch.Tensor]:
    if cuda is None:
        return []
    if not isinstance(cuda, (list, tuple)) or len(cuda) > 1 << 16:
        raise _bad("'cuda'", f"expected a list of per-device states, got {_show(cuda)}")
    size = None
    if torch.cuda.is_available() and torch.cuda.device_count():
        size = torch.cuda.get_rng_state(0).numel()
    return [_byte_state(s, f"'cuda'[{i}]", size) for i, s in enumerate(cuda)]


class GlobalRNG:
    """``Stateful`` wrapper around the global RNGs of this process."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def check(state: Any) -> None:
        """Raise :class:`~unbroken.errors.CorruptCheckpointError` (naming the field) unless
        ``state`` is a complete, valid RNG state that :meth:`load_state_dict` will set without
        error; :class:`~unbroken.errors.StateMismatchError` if a generator state has another
        size than this process's generator. Touches no generator. ``state`` may be the
        decoded ``StatefulValue``."""
        _validated(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every global generator from ``state``; all of it is checked first, so a bad state
        raises :class:`~unbroken.errors.CorruptCheckpointError` with nothing changed."""
        py, npst, cpu, cuda = _validated(state)
        random.setstate(py)
        np.random.set_state(npst)
        torch.set_rng_state(cpu)
        if cuda:
            if not torch.cuda.is_available():
                warnings.warn(
                    "the checkpoint holds CUDA RNG states but CUDA is not available here; "
                    "GPU random streams are not restored",
                    stacklevel=3,
                )
            elif len(cuda) != torch.cuda.device_count():
                warnings.warn(
                    f"the checkpoint holds {len(cuda)} CUDA RNG states but {torch.cuda.device_count()} "
                    "devices are visible; restoring the common ones only",
                    stacklevel=3,
                )
                for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(s, i)
            else:
                torch.cuda.set_rng_state_all(cuda)


def _validated(state: Any) -> tuple[tuple[int, tuple[int, ...], float | None], dict[str, Any], torch.Tensor,
                                    list[torch.Tensor]]:
    """Every part of ``state`` checked and in the form to set, or CorruptCheckpointError."""
    if isinstance(state, StatefulValue):
        state = state.value
    if not isinstance(state, dict):
        raise _bad("", f"expected a dict of generator states, got {_show(state)}")
    for k in ("python", "numpy", "torch"):
        if k not in state:
            raise _bad(repr(k), "missing")
    py = python_state(state["python"])
    npst = _numpy_state(state["numpy"])
    cpu = _byte_state(state["torch"], "'torch'", torch.get_rng_state().numel())
    cuda = _cuda_states(state.get("cuda"))
    # Set each state on a scratch generator: what the real ones will accept, checked on copies.
    try:
        random.Random().setstate(py)
    except (TypeError, ValueError, OverflowError) as e:
        raise _bad("'python'", f"refused by random.setstate ({e})") from None
    try:
        np.random.RandomState().set_state(npst)
    except (TypeError, ValueError, OverflowError, KeyError, IndexError) as e:
        raise _bad("'numpy'", f"refused by np.random.set_state ({e})") from None
    try:
        torch.Generator().set_state(cpu)
    except (TypeError, ValueError, RuntimeError) as e:
        raise _bad("'torch'", f"refused by torch.set_rng_state ({e})") from None
    return py, npst, cpu, cuda
