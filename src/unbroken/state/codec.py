"""Pickle-free encoding of a state tree: JSON nodes with explicit type tags.

Every leaf that is not a tensor becomes JSON. Anything JSON cannot say exactly
(tuples, non-string dict keys, bytes, nan/inf, numpy scalars, dtypes, generators,
``Stateful`` objects) becomes an object ``{"@": tag, ...}``. Tensors and numpy
arrays are handed to a :class:`TensorSink`, which stores them in safetensors files
and returns the reference written into the tree.

Decoding, the strict mirror image, is :mod:`.decoder`.
"""

from __future__ import annotations

import base64
import math
import pathlib
import random
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import UnsupportedStateError
from .stateful import is_stateful

TAG = "@"
_MAX_JSON_INT_BITS = 8192
_CANONICAL_NAN = struct.pack(">d", float("nan")).hex()
PathT = tuple[Any, ...]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_NP_BITGENS = {
    name: getattr(np.random, name)
    for name in ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
    if hasattr(np.random, name)
}
SUPPORTED_TYPES = (
    "None, bool, int, float, str, bytes, complex, list, tuple, dict, set, torch.Tensor, "
    "numpy arrays and scalars, torch/numpy dtypes, torch.device, torch.Generator, "
    "numpy Generator/RandomState, random.Random, pathlib paths, and any object with "
    "state_dict()/load_state_dict()"
)


def render_path(path: PathT) -> str:
    """``("optimizer", "param_groups", 0)`` -> ``state["optimizer"]["param_groups"][0]``."""
    out = ["state"]
    for k in path:
        out.append(f'["{k}"]' if isinstance(k, str) else f"[{k!r}]")
    return "".join(out)


class TensorSink(Protocol):
    """Receives the tensors of a tree being encoded."""

    def add(self, tensor: torch.Tensor, path: PathT) -> dict[str, Any]:
        """Store ``tensor`` and return the JSON reference (``file``, ``key``)."""
        ...

    def add_sharded(self, tensor: torch.Tensor, path: PathT) -> dict[str, Any]:
        """Collect a DTensor (saved by all ranks together) and return its reference (``fqn``)."""
        ...


@dataclass(frozen=True)
class StatefulValue:
    """Decoded form of a saved ``Stateful`` object: its class name and state dict."""

    cls: str
    value: Any


def qualname(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s class (how a Stateful object's class is recorded)."""
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def is_sharded(t: Any) -> bool:
    """True for a tensor saved by all ranks together through DCP: a DTensor, or any object that
    speaks DCP's checkpointable protocol (:class:`unbroken.dist.flatshard.FlatShard`)."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(type(t), "__create_chunk_list__")


class Encoder:
    """Turns a state tree into JSON nodes, sending tensors to ``sink``."""

    def __init__(self, sink: TensorSink) -> None:
        self.sink = sink
        self._stack: set[int] = set()

    def encode(self, obj: Any, path: PathT = ()) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is str:
            return obj
        if t is int:
            # Past ~4300 digits Python refuses to print or parse a decimal int
            # (sys.get_int_max_str_digits), so very large ints go as hex.
            return obj if obj.bit_length() <= _MAX_JSON_INT_BITS else {TAG: "int", "hex": hex(obj)}
        if t is float:
            if math.isfinite(obj):
                return obj
            node = {TAG: "float", "v": repr(obj)}
            bits = struct.pack(">d", obj).hex()
            if obj != obj and bits != _CANONICAL_NAN:
                node["bits"] = bits  # keep the sign and payload of a NaN (inf - inf is -nan on x86)
            return node
        if is_sharded(obj):  # sharded across ranks: saved through torch.distributed.checkpoint
            ref = dict(self.sink.add_sharded(obj, path))
            ref[TAG] = "dtensor"
            return ref
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj, path)
        if isinstance(obj, np.generic):
            return self._np_scalar(obj, path)
        if isinstance(obj, (dict, list, tuple, set, frozenset)) and t not in (
            dict, OrderedDict, list, tuple, set, frozenset, torch.Size
        ):
            # A subclass (namedtuple, defaultdict, ...) would come back as its base
            # class: refuse rather than silently change the type.
            self._unsupported(obj, path)
        if id(obj) in self._stack:
            raise UnsupportedStateError(f"{render_path(path)} contains itself (a reference cycle).")
        self._stack.add(id(obj))
        try:
            return self._container_or_object(obj, path)
        finally:
            self._stack.discard(id(obj))

    def _container_or_object(self, obj: Any, path: PathT) -> Any:
        t = type(obj)
        if t is list:
            return [self.encode(v, path + (i,)) for i, v in enumerate(obj)]
        if t is tuple:
            return {TAG: "tuple", "v": [self.encode(v, path + (i,)) for i, v in enumerate(obj)]}
        if t is torch.Size:
            return {TAG: "size", "v": list(obj)}
        if t in (dict, OrderedDict):
            return self._dict(obj, path)
        if t in (set, frozenset):
            items = [self.encode(v, path + ("<item>",)) for v in obj]
            return {TAG: t.__name__, "v": items}
        if t in (bytes, bytearray):
            return {TAG: t.__name__, "b64": base64.b64encode(obj).decode("ascii")}
        if t is complex:
            return {TAG: "complex", "v": [self.encode(obj.real), self.encode(obj.imag)]}
        if t is torch.dtype:
            return {TAG: "dtype", "v": str(obj).removeprefix("torch.")}
        if t is torch.device:
            return {TAG: "device", "v": str(obj)}
        if isinstance(obj, np.dtype):
            self._check_np_dtype(obj, path)
            return {TAG: "np_dtype", "v": obj.str}
        if t is torch.Generator:
            state = obj.get_state()
            return {TAG: "torch_generator", "device": str(obj.device),
                    "state": self.encode(state, path + ("<generator state>",))}
        if t is np.random.Generator:
            return {TAG: "np_generator", "state": self.encode(obj.bit_generator.state, path)}
        if t is np.random.RandomState:
            return {TAG: "np_randomstate", "state": self.encode(obj.get_state(legacy=False), path)}
        if t is random.Random:
            return {TAG: "py_random", "state": self.encode(obj.getstate(), path)}
        if isinstance(obj, pathlib.PurePath):
            return {TAG: "path", "posix": isinstance(obj, pathlib.PurePosixPath), "v": str(obj)}
        if is_stateful(obj):
            return {TAG: "stateful", "class": qualname(obj), "v": self.encode(obj.state_dict(), path)}
        self._unsupported(obj, path)

    def _dict(self, obj: dict, path: PathT) -> dict[str, Any]:
        node: dict[str, Any] = {TAG: "dict"}
        if all(type(k) is str for k in obj):
            node["v"] = {k: self.encode(v, path + (k,)) for k, v in obj.items()}
        else:
            node["items"] = [
                [self.encode(k, path + ("<key>",)), self.encode(v, path + (k,))] for k, v in obj.items()
            ]
        if type(obj) is OrderedDict:
            node["ordered"] = True
        meta = getattr(obj, "_metadata", None)  # nn.Module.state_dict() version info
        if meta is not None:
            node["meta"] = self.encode(meta, path + ("<_metadata>",))
        return node

    def _tensor(self, t: torch.Tensor, path: PathT) -> dict[str, Any]:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"{render_path(path)} is a tensor subclass {qualname(t)}; save a plain "
                "tensor instead (e.g. t.full_tensor() for a DTensor)."
            )
        if t.layout != torch.strided:
            raise UnsupportedStateError(
                f"{render_path(path)} is a {t.layout} tensor; convert it with .to_dense() first."
            )
        if t.is_quantized or t.is_nested or t.device.type == "meta":
            raise UnsupportedStateError(
                f"{render_path(path)} is a quantized, nested or meta tensor, which cannot be saved."
            )
        ref = dict(self.sink.add(t, path))
        ref[TAG] = "tensor"
        ref["device"] = str(t.device)
        if t.requires_grad:
            ref["requires_grad"] = True
        return ref

    def _ndarray(self, a: np.ndarray, path: PathT) -> dict[str, Any]:
        self._check_np_dtype(a.dtype, path)
        if a.dtype.kind not in "biufc":
            raise UnsupportedStateError(
                f"{render_path(path)} is a numpy array of dtype {a.dtype}; only numeric and "
                "bool arrays can be saved (convert strings to a list)."
            )
        native = a.astype(a.dtype.newbyteorder("="), copy=False)
        if not native.flags.c_contiguous or not native.flags.writeable:
            # (np.ascontiguousarray would turn a 0-d array into shape (1,); torch warns
            # about read-only arrays, which are only read here but copied to stay quiet)
            native = native.copy(order="C")
        ref = dict(self.sink.add(torch.from_numpy(native), path))
        ref[TAG] = "ndarray"
        ref["dtype"] = a.dtype.str
        return ref

    def _np_scalar(self, x: np.generic, path: PathT) -> dict[str, Any]:
        self._check_np_dtype(x.dtype, path)
        if x.dtype.kind not in "biufc":
            self._unsupported(x, path)
        return {TAG: "np_scalar", "dtype": x.dtype.str, "hex": x.tobytes().hex()}

    @staticmethod
    def _check_np_dtype(dt: np.dtype, path: PathT) -> None:
        if dt.kind not in "biufcSU" or dt.fields is not None or dt.subdtype is not None:
            raise UnsupportedStateError(f"{render_path(path)} has numpy dtype {dt!r}, which cannot be saved.")

    @staticmethod
    def _unsupported(obj: Any, path: PathT) -> None:
        raise UnsupportedStateError(
            f"{render_path(path)} is a {qualname(obj)}, which unbroken cannot save without pickle. "
            "Give its class state_dict() (returning plain values and tensors) and "
            "load_state_dict(d) so it is Stateful, or convert it to a supported type: "
            f"{SUPPORTED_TYPES}."
        )
