"""Decoding the tagged JSON of ``state.json`` back into Python objects (see :mod:`.codec`).

Strict: an unknown tag, a malformed node or a reference to a tensor that does not
exist raises :class:`CorruptCheckpointError`. Nothing named by the checkpoint is
imported, called or instantiated except from fixed allow-lists (torch dtypes, numpy
bit generators); a ``stateful`` node's class name is informational only.
"""

from __future__ import annotations

import base64
import pathlib
import random
import struct
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from .codec import _NP_BITGENS, _TORCH_DTYPES, TAG, StatefulValue



def _corrupt(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"state tree: {msg}")


class Decoder:
    """Turns JSON nodes back into Python objects; ``resolve`` looks up tensors."""

    def __init__(self, resolve: Callable[[dict[str, Any]], torch.Tensor],
                 sharded: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.resolve = resolve
        self.sharded = sharded
        self._depth = 0

    def decode(self, node: Any) -> Any:
        self._depth += 1
        if self._depth > 500:
            raise _corrupt("nesting deeper than 500 levels")
        try:
            return self._decode(node)
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError, RuntimeError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise _corrupt(f"malformed node ({type(e).__name__}: {e})") from None
        finally:
            self._depth -= 1

    def _decode(self, node: Any) -> Any:
        t = type(node)
        if node is None or t in (bool, int, float, str):
            return node
        if t is list:
            return [self.decode(v) for v in node]
        if t is not dict or TAG not in node:
            raise _corrupt(f"untagged object {str(node)[:80]!r}")
        tag = node[TAG]
        handler = getattr(self, f"_d_{tag}", None) if isinstance(tag, str) else None
        if handler is None:
            raise _corrupt(f"unknown tag {tag!r}")
        return handler(node)

    def _d_float(self, n: dict) -> float:
        if n["v"] not in ("nan", "inf", "-inf"):
            raise _corrupt(f"bad float {n['v']!r}")
        if "bits" in n:
            raw = bytes.fromhex(_str(n["bits"]))
            x = struct.unpack(">d", raw)[0] if len(raw) == 8 else 0.0
            if n["v"] != "nan" or x == x:
                raise _corrupt(f"bad NaN bits {n['bits']!r}")
            return x
        return float(n["v"])

    def _d_int(self, n: dict) -> int:
        return int(_str(n["hex"]), 16)

    def _d_tuple(self, n: dict) -> tuple:
        return tuple(self.decode(v) for v in _list(n["v"]))

    def _d_size(self, n: dict) -> torch.Size:
        return torch.Size([_int(v) for v in _list(n["v"])])

    def _d_dict(self, n: dict) -> dict:
        out: dict = OrderedDict() if n.get("ordered") else {}
        if "v" in n:
            if type(n["v"]) is not dict:
                raise _corrupt("dict node without an object")
            for k, v in n["v"].items():
                out[k] = self.decode(v)
        else:
            for pair in _list(n["items"]):
                k, v = _list(pair)
                out[self.decode(k)] = self.decode(v)
        if "meta" in n:
            meta = self.decode(n["meta"])
            if isinstance(out, OrderedDict):
                out._metadata = meta  # type: ignore[attr-defined]
        return out

    def _d_set(self, n: dict) -> set:
        return {self.decode(v) for v in _list(n["v"])}

    def _d_frozenset(self, n: dict) -> frozenset:
        return frozenset(self.decode(v) for v in _list(n["v"]))

    def _d_bytes(self, n: dict) -> bytes:
        return base64.b64decode(_str(n["b64"]), validate=True)

    def _d_bytearray(self, n: dict) -> bytearray:
        return bytearray(self._d_bytes(n))

    def _d_complex(self, n: dict) -> complex:
        re, im = (self.decode(v) for v in _list(n["v"]))
        return complex(float(re), float(im))

    def _d_dtype(self, n: dict) -> torch.dtype:
        if n["v"] not in _TORCH_DTYPES:
            raise _corrupt(f"unknown torch dtype {n['v']!r}")
        return _TORCH_DTYPES[n["v"]]

    def _d_device(self, n: dict) -> torch.device:
        return torch.device(_str(n["v"]))

    def _d_np_dtype(self, n: dict) -> np.dtype:
        return _np_dtype(n["v"], "biufcSU")

    def _d_np_scalar(self, n: dict) -> np.generic:
        dt = _np_dtype(n["dtype"], "biufc")
        raw = bytes.fromhex(_str(n["hex"]))
        if len(raw) != dt.itemsize:
            raise _corrupt("numpy scalar of the wrong size")
        return np.frombuffer(raw, dtype=dt)[0]

    def _d_tensor(self, n: dict) -> torch.Tensor:
        t = self.resolve(n)
        if n.get("requires_grad"):
            t.requires_grad_(True)
        return t

    def _d_dtensor(self, n: dict) -> Any:
        if self.sharded is None:
            raise _corrupt("a sharded tensor where none can be")
        return self.sharded(n)

    def _d_ndarray(self, n: dict) -> np.ndarray:
        dt = _np_dtype(n["dtype"], "biufc")
        arr = self.resolve(n).numpy()
        if arr.dtype.itemsize != dt.itemsize or arr.dtype.kind != dt.kind:
            raise _corrupt(f"array stored as {arr.dtype} but recorded as {dt}")
        return arr.astype(dt, copy=False)

    def _d_torch_generator(self, n: dict) -> torch.Generator:
        device = torch.device(_str(n["device"]))
        g = torch.Generator(device=device) if device.type != "cuda" or torch.cuda.is_available() \
            else torch.Generator()
        g.set_state(self.decode(n["state"]))
        return g

    def _d_np_generator(self, n: dict) -> np.random.Generator:
        state = self.decode(n["state"])
        name = state.get("bit_generator") if isinstance(state, dict) else None
        if name not in _NP_BITGENS:
            raise _corrupt(f"unknown numpy bit generator {name!r}")
        bg = _NP_BITGENS[name]()
        bg.state = state
        return np.random.Generator(bg)

    def _d_np_randomstate(self, n: dict) -> np.random.RandomState:
        rs = np.random.RandomState()
        rs.set_state(self.decode(n["state"]))
        return rs

    def _d_py_random(self, n: dict) -> random.Random:
        r = random.Random()
        r.setstate(_to_tuples(self.decode(n["state"])))
        return r

    def _d_path(self, n: dict) -> pathlib.PurePath:
        if n.get("posix"):
            return pathlib.Path(_str(n["v"])) if isinstance(pathlib.Path(), pathlib.PurePosixPath) \
                else pathlib.PurePosixPath(_str(n["v"]))
        return pathlib.PureWindowsPath(_str(n["v"]))

    def _d_stateful(self, n: dict) -> StatefulValue:
        return StatefulValue(_str(n["class"]), self.decode(n["v"]))


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _list(x: Any) -> list:
    if type(x) is not list:
        raise _corrupt(f"expected a list, got {type(x).__name__}")
    return x


def _str(x: Any) -> str:
    if type(x) is not str:
        raise _corrupt(f"expected a string, got {type(x).__name__}")
    return x


def _int(x: Any) -> int:
    if type(x) is not int:
        raise _corrupt(f"expected an integer, got {type(x).__name__}")
    return x


def _np_dtype(s: Any, kinds: str) -> np.dtype:
    dt = np.dtype(_str(s)) if len(_str(s)) <= 8 else None
    if dt is None or dt.kind not in kinds or dt.fields is not None or dt.subdtype is not None:
        raise _corrupt(f"numpy dtype {s!r} not allowed")
    return dt
