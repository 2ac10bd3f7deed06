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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from .codec import _NP_BITGENS, _TORCH_DTYPES, TAG, StatefulValue

MAX_DEPTH = 500  # levels of nesting in a state tree (the Python stack may allow fewer: see decode)


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
        """The Python object of ``node``; any defect raises :class:`CorruptCheckpointError`."""
        try:
            return self._node(node)
        except RecursionError:  # converted here, at the top, once the stack has unwound
            raise _corrupt("nesting too deep for the Python stack") from None

    def _node(self, node: Any) -> Any:
        # Frames per level of nesting are kept few (one for a list, two for a tagged node), so
        # that any tree the encoder could write decodes within Python's recursion limit.
        t = type(node)
        if node is None or t is bool or t is int or t is float or t is str:
            return node
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _corrupt(f"nesting deeper than {MAX_DEPTH} levels")
            if t is list:
                out = []
                for v in node:
                    out.append(self._node(v))
                return out
            if t is not dict or TAG not in node:
                raise _corrupt(f"untagged object {_clip(node)}")
            tag = node[TAG]
            handler = getattr(self, f"_d_{tag}", None) if isinstance(tag, str) else None
            if handler is None:
                raise _corrupt(f"unknown tag {_clip(tag)}")
            return handler(node)
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError, RuntimeError,
                MemoryError) as e:
            if isinstance(e, (CorruptCheckpointError, RecursionError)):
                raise
            raise _corrupt(f"malformed node ({type(e).__name__}: {_clip(e)})") from None
        finally:
            self._depth -= 1

    def _items(self, nodes: Any) -> list:
        out = []
        for v in _list(nodes):
            out.append(self._node(v))
        return out

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
        return tuple(self._items(n["v"]))

    def _d_size(self, n: dict) -> torch.Size:
        return torch.Size([_int(v) for v in _list(n["v"])])

    def _d_dict(self, n: dict) -> dict:
        out: dict = OrderedDict() if n.get("ordered") else {}
        if "v" in n:
            if type(n["v"]) is not dict:
                raise _corrupt("dict node without an object")
            for k, v in n["v"].items():
                out[k] = self._node(v)
        else:
            for pair in _list(n["items"]):
                k, v = _list(pair)
                out[self._node(k)] = self._node(v)
        if "meta" in n:
            meta = self._node(n["meta"])
            if isinstance(out, OrderedDict):
                out._metadata = meta  # type: ignore[attr-defined]
        return out

    def _d_set(self, n: dict) -> set:
        return set(self._items(n["v"]))

    def _d_frozenset(self, n: dict) -> frozenset:
        return frozenset(self._items(n["v"]))

    def _d_bytes(self, n: dict) -> bytes:
        return base64.b64decode(_str(n["b64"]), validate=True)

    def _d_bytearray(self, n: dict) -> bytearray:
        return bytearray(self._d_bytes(n))

    def _d_complex(self, n: dict) -> complex:
        re, im = self._items(n["v"])
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
        g.set_state(self._node(n["state"]))
        return g

    def _d_np_generator(self, n: dict) -> np.random.Generator:
        state = self._node(n["state"])
        name = state.get("bit_generator") if isinstance(state, dict) else None
        if type(name) is not str or name not in _NP_BITGENS:
            raise _corrupt(f"unknown numpy bit generator {_clip(name)}")
        bg = _NP_BITGENS[name]()
        _check_like(state, bg.state, f"numpy {name} state")
        check_not_degenerate(name, state)
        bg.state = state
        return np.random.Generator(bg)

    def _d_np_randomstate(self, n: dict) -> np.random.RandomState:
        rs = np.random.RandomState()
        state = self._node(n["state"])
        _check_like(state, rs.get_state(legacy=False), "numpy RandomState state")
        check_not_degenerate("MT19937", state)
        rs.set_state(state)
        return rs

    def _d_py_random(self, n: dict) -> random.Random:
        from .rng import python_state  # checks what random.setstate takes on trust (gauss_next)

        r = random.Random()
        r.setstate(python_state(_to_tuples(self._node(n["state"])), "random.Random"))
        return r

    def _d_path(self, n: dict) -> pathlib.PurePath:
        if n.get("posix"):
            return pathlib.Path(_str(n["v"])) if isinstance(pathlib.Path(), pathlib.PurePosixPath) \
                else pathlib.PurePosixPath(_str(n["v"]))
        return pathlib.PureWindowsPath(_str(n["v"]))

    def _d_stateful(self, n: dict) -> StatefulValue:
        return StatefulValue(_str(n["class"]), self._node(n["v"]))


# numpy stores these indices in C and trusts them: an out-of-range position set through
# ``.state`` reads outside the key buffer at the next draw (a crash, measured). Upper bounds
# of the integer fields of the allowed bit generators' states; other integers: 128 bits.
_INT_FIELDS = {"pos": 624, "buffer_pos": 4, "has_uint32": 1, "has_gauss": 1, "uinteger": 2**32 - 1}


def _check_like(state: Any, template: Any, where: str, field: str = "") -> None:
    """``state`` has exactly the structure of ``template`` (a fresh generator's state): the same
    keys, arrays of the same dtype and shape, strings equal, integers within their field's range."""
    if isinstance(template, dict):
        if not isinstance(state, dict) or state.keys() != template.keys():
            keys = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
            raise _corrupt(f"{where}: expected the fields {sorted(template)}, got {keys}")
        for k in template:
            _check_like(state[k], template[k], f"{where}[{k!r}]", k)
    elif isinstance(template, np.ndarray):
        if not isinstance(state, np.ndarray) or state.dtype != template.dtype or state.shape != template.shape:
            got = f"{state.dtype} {state.shape}" if isinstance(state, np.ndarray) else type(state).__name__
            raise _corrupt(f"{where}: expected a {template.dtype} array of shape {template.shape}, got {got}")
    elif isinstance(template, str):
        if type(state) is not str or state != template:
            raise _corrupt(f"{where}: expected {template!r}, got {_clip(state)}")
    elif isinstance(template, float):
        if not isinstance(state, (float, np.floating)):
            raise _corrupt(f"{where}: expected a float, got {type(state).__name__}")
    elif isinstance(template, (int, np.integer)):
        top = _INT_FIELDS.get(field, 2**128 - 1)
        if isinstance(state, (bool, np.bool_)) or not isinstance(state, (int, np.integer)) or not 0 <= state <= top:
            raise _corrupt(f"{where}: expected an integer in [0, {top}], got {_clip(state)}")
    else:  # pragma: no cover - a numpy with state fields of a new kind
        raise _corrupt(f"{where}: cannot check a field of type {type(template).__name__}")


def check_not_degenerate(name: str, state: dict) -> None:
    """Refuse a numpy bit-generator state no seeding produces and that makes the generator
    emit one value forever: numpy's bounded integers and normal draws then loop without end
    (measured: ``integers(0, 10)`` and ``standard_normal()`` hang). An all-zero Mersenne
    Twister key (the twister's only fixed point), or a PCG increment that is even (seeding
    always makes it odd; an even one with state 0 stays 0)."""
    inner = state.get("state") if isinstance(state, dict) else None
    if name == "MT19937" and isinstance(inner, dict) and isinstance(inner.get("key"), np.ndarray):
        key = inner["key"]
        if key.size and not (int(key[0]) & 0x80000000) and not key[1:].any():
            raise _corrupt(f"numpy {name} state: the all-zero key of a generator that only draws zeros")
    if name in ("PCG64", "PCG64DXSM") and isinstance(inner, dict):
        inc = inner.get("inc")
        if isinstance(inc, (int, np.integer)) and not int(inc) & 1:
            raise _corrupt(f"numpy {name} state: an even increment, which no seeding produces")


def _clip(x: Any) -> str:
    """``repr(x)`` cut to 80 characters (without building the repr of a huge integer)."""
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 256:
        return f"<an integer of {x.bit_length()} bits>"
    text = repr(x) if not isinstance(x, BaseException) else str(x)
    return text if len(text) <= 80 else text[:77] + "..."


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
