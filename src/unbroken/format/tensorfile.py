"""Tensor files in the safetensors format, written zero-copy and read with full validation.

Files written here are plain safetensors files: ``safetensors.safe_open`` and any
other reader load them. We write and parse the format ourselves for two reasons
(measured in ``benchmarks/``): writing streams each tensor's bytes straight from its
memory into the file and into the checksum in one pass (no second read of the file);
and reading validates the header
of bytes that were *already* checksummed in memory, so what is verified is exactly
what is loaded, with one read and no copy.

Tensors are laid out by descending element size, so every tensor's offset is a
multiple of its element size (the header is padded to 8 bytes, as the format
requires) and loads with ``torch.frombuffer`` without copying.

Reading is bounded: a checksum-valid file may still have been written by anyone, so
its header is trusted for nothing. The limits (the same for every reader of a file):

* ``MAX_HEADER`` (100 MiB, as the official reader) bytes of JSON header, and
* ``MAX_TENSORS`` (1,000,000) tensors per file. A header entry takes about 100 bytes,
  so a full header holds about a million of them. Real models are far below: the
  largest open mixture-of-experts models have on the order of 100k tensors in all,
  their Adam state (two moments and a step per parameter) three times that, and the
  state is spread over one file per top-level key.

A header with more JSON objects or arrays than that many tensors have is refused by
counting its brackets before the JSON is parsed (brackets inside keys count too; the
writer applies the same rule). Parsing then builds the objects in C with the garbage
collector paused; each entry is checked with table lookups (no tensor is made to learn
an element size); every offset, shape and stride is checked against the real data
size before anything is allocated; and tensors are only made, as views of the buffer,
when a key is looked up. Time and memory are linear in the header size.
Measured (2 slow cores): the 89 MB header of 1.5 million empty tensors that took
53 s and 1.4 GB to parse (60 s and 1.9 GB to load) is refused in 0.1 s; a valid
header of a million entries is read in a few seconds.
Writing refuses a file the reader would refuse.
"""

from __future__ import annotations

import contextlib
import gc
import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}
_ITEMSIZE: dict[str, int] = {v: k.itemsize for k, v in DTYPE_TO_ST.items()}
_DTYPE_NAME: dict[str, str] = {v: v for v in ST_TO_DTYPE}
MAX_HEADER = 100 * 1024 * 1024
MAX_TENSORS = 1_000_000
_INT64 = 2**63
_FIELDS = {"dtype", "shape", "data_offsets"}
_CHUNK = 64 * 1024 * 1024


@dataclass
class TensorEntry:
    """One tensor to write: its key in the file and a CPU, contiguous tensor."""

    key: str
    tensor: torch.Tensor


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # a buffer


def layout(entries: Iterable[TensorEntry], metadata: dict[str, str] | None = None) -> tuple[bytes, list[TensorEntry]]:
    """Order ``entries`` for alignment and build the safetensors header bytes."""
    ordered = sorted(entries, key=lambda e: -e.tensor.element_size())
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for e in ordered:
        if e.tensor.dtype not in DTYPE_TO_ST:
            raise TypeError(f"dtype {e.tensor.dtype} cannot be stored in a safetensors file")
        n = e.tensor.numel() * e.tensor.element_size()
        header[e.key] = {"dtype": DTYPE_TO_ST[e.tensor.dtype], "shape": list(e.tensor.shape),
                         "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)
    problem = f"{len(raw)} bytes, over the limit of {MAX_HEADER}" if len(raw) > MAX_HEADER else structure_error(raw)
    if problem:
        raise UnsupportedStateError(f"a tensor file header could not be read back ({problem}): use shorter "
                                    "keys, or spread the tensors over more top-level state keys")
    return struct.pack("<Q", len(raw)) + raw, ordered


def write_tensor_file(
    f: BinaryIO,
    entries: Iterable[TensorEntry],
    update: Callable[[memoryview | bytes], None],
    metadata: dict[str, str] | None = None,
    on_half: Callable[[], None] | None = None,
) -> int:
    """Write a safetensors file to ``f``, feeding every byte to ``update`` (the checksum).

    ``on_half`` is called once, after about half of the tensor bytes are written
    (used by fault-injection tests). Returns the number of bytes written.
    """
    head, ordered = layout(entries, metadata)
    f.write(head)
    update(head)
    total = sum(e.tensor.numel() * e.tensor.element_size() for e in ordered)
    written = 0
    for e in ordered:
        mv = raw_bytes(e.tensor)
        for i in range(0, len(mv), _CHUNK):
            chunk = mv[i : i + _CHUNK]
            if on_half is not None and written + len(chunk) >= total // 2:
                half = max(0, total // 2 - written)
                f.write(chunk[:half])
                f.flush()
                on_half()
                on_half = None
                f.write(chunk[half:])
            else:
                f.write(chunk)
            update(chunk)
            written += len(chunk)
    if on_half is not None:
        on_half()
    return len(head) + written


def _bad(name: str, msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{name}: {msg}")


class _Pairs(list):
    """A JSON object as parsed: its ``(key, value)`` pairs in order, duplicates kept. Built by
    ``json`` in C (no Python call per object), and told apart from a JSON array by its type."""

    __slots__ = ()


def _reject_constant(s: str) -> Any:
    raise ValueError(f"{s} is not JSON")  # NaN, Infinity: never in a safetensors header


def _atom(v: Any) -> str:
    if isinstance(v, list):  # never the repr of a nested value: it may be thousands deep
        return "{...}" if type(v) is _Pairs else "[...]"
    if isinstance(v, tuple):
        return f"{_atom(v[0])}: {_atom(v[1])}"
    if type(v) is int and v.bit_length() > 128:
        return f"<a {v.bit_length()}-bit integer>"
    return repr(v[:40] if type(v) is str else v)


def _short(x: Any) -> str:
    """A short description of a header value for an error message."""
    if isinstance(x, list):
        inner = ", ".join(_atom(v) for v in x[:8]) + (", ..." if len(x) > 8 else "")
        text = "{" + inner + "}" if type(x) is _Pairs else "[" + inner + "]"
    else:
        text = _atom(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _utf8(s: str) -> bool:
    """False for a string holding a lone surrogate (``"\\ud800"`` is valid JSON, but not UTF-8)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def structure_error(header: str | bytes) -> str | None:
    """Why a header cannot be read back, judged before it is parsed, or ``None``: it holds more
    JSON objects or arrays than ``MAX_TENSORS`` tensors have (one object and two arrays each,
    plus the outer object and ``__metadata__``). Brackets are counted in the raw text, so ones
    inside keys count too: the writer refuses such a file as well (see :func:`layout`)."""
    obj, arr = (header.count("{"), header.count("[")) if isinstance(header, str) else \
        (header.count(b"{"), header.count(b"["))
    if obj > MAX_TENSORS + 2 or arr > 2 * MAX_TENSORS:
        return (f"header holds {obj} '{{' and {arr} '[': more than the {MAX_TENSORS} tensors "
                "a file may have")
    return None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: parsing a header creates millions of containers, and
    the collections they trigger (each walking every container alive) made a 1.5-million-entry
    header take tens of seconds instead of a few. Nothing parsed here holds a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _metadata(value: Any, name: str) -> None:
    if type(value) is not _Pairs or len(value) > MAX_TENSORS:
        raise _bad(name, "__metadata__ is not an object of strings")
    seen: set[str] = set()
    for k, v in value:
        if type(v) is not str or not _utf8(k) or not _utf8(v):
            raise _bad(name, f"__metadata__[{_short(k)}] is not a string")
        if k in seen:
            raise _bad(name, f"duplicate __metadata__ key {_short(k)}")
        seen.add(k)


def _nbytes(key: str, dtype: Any, shape: Any, offs: Any, data_len: int, name: str) -> int:
    """The byte count of one tensor entry, every field checked; raises for a malformed entry."""
    itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise _bad(name, f"tensor {_short(key)}: unknown dtype {_short(dtype)}")
    if type(shape) is not list:
        raise _bad(name, f"tensor {_short(key)}: bad shape {_short(shape)}")
    for d in shape:
        if type(d) is not int or not 0 <= d < _INT64:
            raise _bad(name, f"tensor {_short(key)}: bad shape {_short(shape)}")
    if not (type(offs) is list and len(offs) == 2 and type(offs[0]) is int and type(offs[1]) is int):
        raise _bad(name, f"tensor {_short(key)}: bad data_offsets {_short(offs)}")
    if 0 in shape:
        # No data, but torch still computes 64-bit strides: the product of every dimension
        # after the first (a zero counted as one) must fit, or torch.empty() fails later.
        stride = 1
        for d in shape[:0:-1]:
            stride *= d or 1
            if stride >= _INT64:
                raise _bad(name, f"tensor {_short(key)}: shape {_short(shape)} overflows 64-bit strides")
        return 0
    numel = 1
    for d in shape:  # stop once it cannot fit: a million-dim shape must not cost minutes
        numel *= d
        if numel > data_len:
            break
    return numel * itemsize


def parse_header(buf: memoryview, name: str) -> tuple[dict[str, dict[str, Any]], int]:
    """Validate a safetensors header; return the tensor table and where data starts.

    Every size is checked against the buffer before anything is allocated: a header
    longer than the file or than ``MAX_HEADER``, more than ``MAX_TENSORS`` tensors,
    offsets outside the data section, shapes whose byte count does not match their offsets
    (or whose strides overflow 64 bits), holes or overlaps, unknown dtypes, duplicate keys,
    keys that are not UTF-8, JSON ``NaN``/``Infinity`` and a ``__metadata__`` that is not an
    object of strings are rejected. Linear in the header size (see the module docstring).
    """
    if len(buf) < 8:
        raise _bad(name, "file shorter than a safetensors header")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER or n > len(buf) - 8:
        raise _bad(name, f"header claims {n} bytes but the file has {len(buf)}"
                         + (f" (and the limit is {MAX_HEADER})" if n > MAX_HEADER else ""))
    try:
        text = str(buf[8 : 8 + n], "utf-8")
    except UnicodeDecodeError as e:
        raise _bad(name, f"unreadable header ({e})") from None
    problem = structure_error(text)
    if problem:
        raise _bad(name, problem)
    with _gc_paused():
        return _parse_entries(text, len(buf) - 8 - n, name), 8 + n


def _parse_entries(text: str, data_len: int, name: str) -> dict[str, dict[str, Any]]:
    try:
        top = json.loads(text, object_pairs_hook=_Pairs, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: absurd nesting
        raise _bad(name, f"unreadable header ({str(e)[:200]})") from None
    if type(top) is not _Pairs:
        raise _bad(name, "header is not a JSON object")
    if len(top) > MAX_TENSORS + 1:
        raise _bad(name, f"more than {MAX_TENSORS} tensors")
    header: dict[str, dict[str, Any]] = {}
    spans: list[tuple[int, int]] = []
    metadata = False
    for i, (key, info) in enumerate(top):
        top[i] = None  # free each parsed entry once it is converted
        if key == "__metadata__":
            if metadata:
                raise _bad(name, "duplicate key '__metadata__'")
            metadata = True
            _metadata(info, name)
            continue
        if key in header:
            raise _bad(name, f"duplicate key {_short(key)}")
        if not _utf8(key):
            raise _bad(name, f"tensor key {_short(key)} is not UTF-8")
        if type(info) is not _Pairs or len(info) != 3:
            raise _bad(name, f"tensor {_short(key)}: malformed entry")
        (k0, dtype), (k1, shape), (k2, offs) = info
        if k0 != "dtype" or k1 != "shape" or k2 != "data_offsets":  # not the usual order
            fields = dict(info)
            if fields.keys() != _FIELDS:
                raise _bad(name, f"tensor {_short(key)}: malformed entry")
            dtype, shape, offs = fields["dtype"], fields["shape"], fields["data_offsets"]
        nbytes = _nbytes(key, dtype, shape, offs, data_len, name)
        begin, end = offs
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise _bad(name, f"tensor {_short(key)}: shape {_short(shape)} {dtype} does not fit bytes "
                             f"[{begin}, {end}) of a {data_len}-byte data section")
        entry = {"dtype": _DTYPE_NAME[dtype], "shape": shape, "data_offsets": offs}  # one shared dtype string
        header[key] = entry
        spans.append((begin, end))
    del top
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise _bad(name, "tensor data has holes or overlaps")
        pos = end
    if pos != data_len:
        raise _bad(name, f"{data_len - pos} trailing bytes after the last tensor")
    return header


class TensorTable(Mapping[str, torch.Tensor]):
    """The tensors of one validated file, by key: each made on first access (then kept), as a
    view of the buffer, so a file of a million tiny or empty tensors costs nothing until used.
    Making a tensor cannot fail: :func:`parse_header` checked every field."""

    def __init__(self, buf: Any, header: dict[str, dict[str, Any]], start: int) -> None:
        self._buf, self._header, self._start = buf, header, start
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        t = self._made.get(key)
        if t is None:
            t = self._made[key] = self._make(self._header[key])
        return t

    def __contains__(self, key: object) -> bool:
        return key in self._header

    def __iter__(self) -> Iterator[str]:
        return iter(self._header)

    def __len__(self) -> int:
        return len(self._header)

    def _make(self, info: dict[str, Any]) -> torch.Tensor:
        dtype = ST_TO_DTYPE[info["dtype"]]
        begin, end = info["data_offsets"]
        if end == begin:
            return torch.empty(info["shape"], dtype=dtype)
        buf, start = self._buf, self._start
        itemsize = _ITEMSIZE[info["dtype"]]
        if (start + begin) % itemsize:
            # Written by another tool without our alignment: copy to an aligned buffer.
            t = torch.frombuffer(bytearray(buf[start + begin : start + end]), dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype, count=(end - begin) // itemsize, offset=start + begin)
        return t.reshape(info["shape"])


def load_tensor_file(buf: Any, name: str) -> TensorTable:
    """Validate a safetensors buffer; return its tensors (CPU, sharing ``buf``'s memory, made
    on first access: see :class:`TensorTable`)."""
    header, start = parse_header(memoryview(buf), name)
    return TensorTable(buf, header, start)
