#!/usr/bin/env python3
"""An independent reader of unbroken checkpoints, written from ``docs/format.md``.

One file; needs only the Python standard library and numpy (``xxhash`` for ``--verify``).
It never imports unbroken or torch and never unpickles anything.

Command line::

    python tools/unbroken_reader.py CKPT                 # manifest summary and the state tree(s)
    python tools/unbroken_reader.py CKPT --verify        # + manifest trailer, every file's size and checksum
    python tools/unbroken_reader.py CKPT --tensor NAME   # dtype, shape, a few values, min/max/mean
    python tools/unbroken_reader.py CKPT --chunks DIR    # format 3: the run's chunks/ is elsewhere

``CKPT`` is a checkpoint folder (the one holding ``manifest.json``). ``NAME`` is a tensor's
key in its safetensors file (``model/weight``), ``FILE:KEY`` when a key occurs in several
files (``s00001.safetensors:0``), or a sharded tensor's fqn (assembled from its pieces).

Format 3 (incremental checkpoints): a tensor file ``tNN-<key>.safetensors`` is replaced by
its chunk map ``tNN-<key>.chunks.json`` and the tensors' bytes are chunks in the run's
``chunks/`` folder, by default ``CKPT/../chunks`` (``--chunks`` / ``chunks=`` to name
another). Trees keep referring to the ``.safetensors`` name; the reader resolves it through
the map. Every chunk is checked for its size when read; ``--verify`` also checks its
xxh3-128 against the manifest and its SHA-256 against its name.
Exit status: 0 fine; 1 the checkpoint is invalid (the message names the file); 2 usage
error, unknown tensor, or ``--verify`` without the ``xxhash`` package.

Python API::

    read_checkpoint(path) -> dict            # the decoded state tree, like unbroken.load(path)
    open_checkpoint(path) -> Checkpoint      # .manifest, .state(), .rank_state(r), .tensor(file, key),
                                             # .assemble(fqn), .verify(), .find_tensor(name),
                                             # .chunks (format 3: id -> size, xxh3_128)

Values come back as plain Python and numpy: tensors and arrays as numpy arrays (always
copies, C-contiguous, native byte order except an ``ndarray`` saved big-endian). numpy has
no bfloat16 or float8: by default ``BF16`` and the four float8 dtypes are converted
**exactly** to float32 (bf16: the bits shifted left by 16; float8: a 256-entry table);
with ``raw=True`` they come back as their stored bits (uint16 / uint8). Complex tensors
come back complex64/complex128 (torch's complex32 as complex64, exactly). Other torch
objects, which need torch to exist, are small stand-ins: :class:`TorchDtype`,
:class:`TorchDevice` (``str`` subclasses), :class:`TorchSize` (a ``tuple`` subclass),
:class:`TorchGenerator` (device and uint8 state); ``Stateful`` objects are
:class:`Stateful` (class name and state) in :meth:`Checkpoint.state` and their plain
state in :func:`read_checkpoint` (as ``unbroken.load`` returns them). numpy generators
and ``random.Random`` are rebuilt for real.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import mmap
import os
import pathlib
import random
import re
import stat
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import xxhash
except ImportError:  # --verify says it needs it
    xxhash = None

KNOWN_FORMAT_VERSION = 3
FORMAT_NAME = "unbroken"
MANIFEST = "manifest.json"
STATE_FILE = "state.json"
SHARDED_FILE = "sharded.json"
CHUNKS_DIR = "chunks"  # format 3: the run's chunk folder, beside the checkpoint folders
CHUNKMAP_FORMAT = "unbroken-chunkmap"
CHUNKMAP_SUFFIX = ".chunks.json"
TENSOR_SUFFIX = ".safetensors"
RESERVED = "__unbroken__"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_JSON_BYTES = 1 << 31  # state trees and sharded.json: a sanity bound only, they are checksummed
MAX_HEADER = 100 * 1024 * 1024
MAX_TENSORS = 1_000_000  # per tensor file
MAX_DEPTH = 500
MAX_DIMS = 64
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
HEX128 = re.compile(r"^[0-9a-f]{32}$")
CHUNK_ID = re.compile(r"^[0-9a-f]{64}$")  # the SHA-256 of the chunk's bytes
TRAILER_KEY = b',\n "manifest_xxh3_128": "'
TRAILER_END = b'"\n}\n'
TRAILER_LEN = len(TRAILER_KEY) + 32 + len(TRAILER_END)
TAG = "@"
_CHUNK = 16 * 1024 * 1024

# safetensors dtype -> (numpy dtype of the stored bytes, element size, numpy dtype of the value or None)
DTYPES: dict[str, tuple[str, int, str | None]] = {
    "F64": ("<f8", 8, "<f8"), "F32": ("<f4", 4, "<f4"), "F16": ("<f2", 2, "<f2"), "BF16": ("<u2", 2, None),
    "I64": ("<i8", 8, "<i8"), "I32": ("<i4", 4, "<i4"), "I16": ("<i2", 2, "<i2"), "I8": ("i1", 1, "i1"),
    "U64": ("<u8", 8, "<u8"), "U32": ("<u4", 4, "<u4"), "U16": ("<u2", 2, "<u2"), "U8": ("u1", 1, "u1"),
    "BOOL": ("u1", 1, "?"),
    "F8_E4M3": ("u1", 1, None), "F8_E5M2": ("u1", 1, None),
    "F8_E4M3FNUZ": ("u1", 1, None), "F8_E5M2FNUZ": ("u1", 1, None),
}
TORCH_NAMES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
}
ST_TO_TORCH = {v: k for k, v in TORCH_NAMES.items()}
NP_BITGENS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


# ------------------------------------------------------------------------ errors
class FormatError(Exception):
    """The checkpoint is invalid: damaged, malformed or unsafe. The message names the file."""


class NewerFormatError(FormatError):
    """The checkpoint's format version is newer than this reader knows."""


class NeedsXxhash(RuntimeError):
    """Verifying checksums needs the ``xxhash`` package."""


# ------------------------------------------------------------- decoded stand-ins
class TorchDtype(str):
    """A ``torch.dtype`` by name (``"bfloat16"``)."""

    def __repr__(self) -> str:
        return f"torch.{str.__str__(self)}"


class TorchDevice(str):
    """A ``torch.device`` by its string (``"cuda:0"``)."""

    def __repr__(self) -> str:
        return f"device({str.__repr__(self)})"


class TorchSize(tuple):
    """A ``torch.Size``."""

    def __repr__(self) -> str:
        return f"torch.Size({list(self)!r})"


@dataclass(eq=False)
class TorchGenerator:
    """A ``torch.Generator``: its device and ``get_state()`` bytes."""

    device: str
    state: np.ndarray


@dataclass(eq=False)
class Stateful:
    """A saved object with ``state_dict()``: its class name (informational) and its state."""

    cls: str
    value: Any


@dataclass(frozen=True)
class ShardedRef:
    """A sharded tensor not assembled (``assemble=False``)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str


class ByIdentity:
    """A dict key or set item that numpy cannot hash (a tensor: torch hashes tensors by identity)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"ByIdentity({self.value!r})"


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return ByIdentity(x)


def unwrap(x: Any) -> Any:
    """``x`` with every :class:`Stateful` replaced by its state, recursively."""
    if isinstance(x, Stateful):
        return unwrap(x.value)
    if isinstance(x, OrderedDict):
        out = OrderedDict((k, unwrap(v)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata  # type: ignore[attr-defined]
        return out
    if type(x) is dict:
        return {k: unwrap(v) for k, v in x.items()}
    if type(x) is list:
        return [unwrap(v) for v in x]
    if type(x) is tuple:
        return tuple(unwrap(v) for v in x)
    return x


# ------------------------------------------------------------------------ helpers
def xxh3_128_hex(data: Any) -> str:
    """XXH3-128 of ``data`` as 32 lowercase hex digits (canonical, big-endian)."""
    if xxhash is None:
        raise NeedsXxhash("checksum verification needs the xxhash package (pip install xxhash)")
    return xxhash.xxh3_128(data).hexdigest()


def _hash_buffer(buf: Any) -> str:
    if xxhash is None:
        raise NeedsXxhash("checksum verification needs the xxhash package (pip install xxhash)")
    h = xxhash.xxh3_128()
    mv = memoryview(buf)
    for i in range(0, len(mv), _CHUNK):
        h.update(mv[i:i + _CHUNK])
    return h.hexdigest()


def check_name(name: Any) -> str:
    """``name`` if it is one plain, safe path component (§3), else :class:`FormatError`."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise FormatError(f"manifest.json lists an unsafe or invalid file name {name!r}")
    return name


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def parse_json(raw: Any, fname: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity literals."""
    try:
        return json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_strict_object,
                          parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{fname} does not parse ({type(e).__name__}: {e})") from None


def _utf8(s: str) -> bool:
    """False for a string with a lone surrogate (valid JSON ``"\\ud800"``, but not UTF-8)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x: Any) -> bool:
    return type(x) is int


def _numel(shape: Iterable[int], limit: int | None = None) -> int:
    n = 1
    for d in shape:
        if limit is not None and n > limit:  # stop early: a huge shape must not take long
            return limit + 1
        n *= d
    return n


# ------------------------------------------------------------ dtype conversions
_F8_TABLES: dict[str, np.ndarray] = {}


def _f8_value(fmt: str, b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    if fmt in ("F8_E4M3FNUZ", "F8_E5M2FNUZ") and b == 0x80:
        return math.nan
    if fmt in ("F8_E4M3", "F8_E4M3FNUZ"):
        e, m, bias, mbits = (b >> 3) & 0xF, b & 0x7, (7 if fmt == "F8_E4M3" else 8), 3
        if fmt == "F8_E4M3" and e == 0xF and m == 0x7:
            return math.nan
    else:
        e, m, bias, mbits = (b >> 2) & 0x1F, b & 0x3, (15 if fmt == "F8_E5M2" else 16), 2
        if fmt == "F8_E5M2" and e == 0x1F:
            return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m / (1 << mbits), 1 - bias)
    return sign * math.ldexp(1 + m / (1 << mbits), e - bias)


def f8_table(fmt: str) -> np.ndarray:
    """float32 value of each of the 256 bit patterns of a float8 format."""
    if fmt not in _F8_TABLES:
        _F8_TABLES[fmt] = np.array([_f8_value(fmt, b) for b in range(256)], dtype=np.float32)
    return _F8_TABLES[fmt]


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact: a bfloat16 is the upper half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_value(stored: np.ndarray, st_dtype: str) -> np.ndarray:
    """Stored bits -> numpy values (BF16/F8 as float32; BOOL as bool)."""
    if st_dtype == "BF16":
        return bf16_to_float32(stored)
    if st_dtype.startswith("F8_"):
        return f8_table(st_dtype)[stored]
    if st_dtype == "BOOL":
        return stored != 0
    return stored.astype(DTYPES[st_dtype][2], copy=False)


# ------------------------------------------------------------------ safetensors
@dataclass(frozen=True)
class TensorInfo:
    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file (in the chunk: 0 and its size)
    end: int
    chunk: str | None = None  # format 3: the chunk holding the bytes, for a tensor file resolved by its map


def parse_safetensors_header(buf: Any, fname: str) -> dict[str, TensorInfo]:
    """Validate a safetensors header against the file (§8.3) and return its tensors."""
    size = len(buf)
    if size < 8:
        raise FormatError(f"{fname}: file shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > MAX_HEADER or n > size - 8:
        raise FormatError(f"{fname}: header claims {n} bytes but the file has {size}")
    raw = bytes(buf[8:8 + n])
    if raw.count(b"{") > MAX_TENSORS + 2 or raw.count(b"[") > 2 * MAX_TENSORS:  # before parsing
        raise FormatError(f"{fname}: header holds more JSON objects or arrays than {MAX_TENSORS} tensors have")
    header = parse_json(raw, f"{fname} (header)")
    if not isinstance(header, dict):
        raise FormatError(f"{fname}: header is not a JSON object")
    if len(header) > MAX_TENSORS + 1:
        raise FormatError(f"{fname}: more than {MAX_TENSORS} tensors")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for key, info in header.items():
        if not _utf8(key):
            raise FormatError(f"{fname}: tensor key {key[:80]!r} is not UTF-8")
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) and _utf8(k) and _utf8(v)
                                                     for k, v in info.items()):
                raise FormatError(f"{fname}: __metadata__ is not an object of strings")
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{fname}: tensor {key!r}: malformed entry")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"{fname}: tensor {key!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 2**63 for d in shape):
            raise FormatError(f"{fname}: tensor {key!r}: bad shape {str(shape)[:80]}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
            raise FormatError(f"{fname}: tensor {key!r}: bad data_offsets {str(offs)[:80]}")
        begin, end = offs
        _check_strides(shape, fname, key)
        nbytes = 0 if 0 in shape else _numel(shape, data_len) * DTYPES[dtype][1]
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise FormatError(f"{fname}: tensor {key!r}: shape {str(shape)[:80]} {dtype} does not fit bytes "
                              f"[{begin}, {end}) of a {data_len}-byte data section")
        spans.append((begin, end))
        out[key] = TensorInfo(fname, key, dtype, tuple(shape), 8 + n + begin, 8 + n + end)
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise FormatError(f"{fname}: tensor data has holes or overlaps")
        pos = end
    if pos != data_len:
        raise FormatError(f"{fname}: {data_len - pos} trailing bytes after the last tensor")
    return out


def _check_strides(shape: list[int], fname: str, key: str) -> None:
    """An empty tensor (a 0 in its shape) has no data, but its strides must fit 64 bits: the
    product of the dimensions after the first, zeros counted as 1, is below 2**63."""
    if 0 in shape:
        stride = 1
        for d in shape[:0:-1]:
            stride *= d or 1
            if stride >= 2**63:
                raise FormatError(f"{fname}: tensor {key!r}: shape {str(shape)[:80]} overflows 64-bit strides")


# ------------------------------------------------------------------- chunk maps
def map_name(tensor_file: str) -> str:
    """Format 3: the chunk map standing for a tensor file (``t00-model.safetensors`` ->
    ``t00-model.chunks.json``)."""
    return tensor_file[:-len(TENSOR_SUFFIX)] + CHUNKMAP_SUFFIX


def parse_chunk_map(raw: Any, fname: str, tensor_file: str, chunks: dict[str, dict[str, Any]]
                    ) -> dict[str, TensorInfo]:
    """Validate a chunk map (§8.5) against the manifest's ``chunks`` and return the tensors of
    ``tensor_file`` it describes (each with the chunk holding its bytes)."""
    doc = parse_json(raw, fname)
    if not isinstance(doc, dict) or doc.get("format") != CHUNKMAP_FORMAT:
        raise FormatError(f"{fname} is not a chunk map (format must be {CHUNKMAP_FORMAT!r})")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise FormatError(f"{fname}: tensors is not an object")
    if len(tensors) > MAX_TENSORS:
        raise FormatError(f"{fname}: more than {MAX_TENSORS} tensors")
    out: dict[str, TensorInfo] = {}
    for key, entry in tensors.items():
        if not _utf8(key):
            raise FormatError(f"{fname}: tensor key {key[:80]!r} is not UTF-8")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "chunk"}:
            raise FormatError(f"{fname}: tensor {key!r}: malformed entry (needs exactly dtype, shape, chunk)")
        dtype, shape, cid = entry["dtype"], entry["shape"], entry["chunk"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"{fname}: tensor {key!r}: unknown dtype {str(dtype)[:40]!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
                not all(_is_int(d) and 0 <= d < 1 << 62 for d in shape):
            raise FormatError(f"{fname}: tensor {key!r}: bad shape {str(shape)[:80]}")
        _check_strides(shape, fname, key)
        if not isinstance(cid, str) or not CHUNK_ID.fullmatch(cid):
            raise FormatError(f"{fname}: tensor {key!r}: invalid chunk id {str(cid)[:80]!r}")
        if cid not in chunks:
            raise FormatError(f"{fname}: tensor {key!r} uses chunk {cid}, which the manifest does not list")
        size = chunks[cid]["size"]
        nbytes = 0 if 0 in shape else _numel(shape, size) * DTYPES[dtype][1]  # stops early past size
        if nbytes != size:
            raise FormatError(f"{fname}: tensor {key!r}: shape {str(shape)[:80]} {dtype} does not fit chunk "
                              f"{cid} ({size} bytes)")
        out[key] = TensorInfo(tensor_file, key, dtype, tuple(shape), 0, size, cid)
    return out


# ------------------------------------------------------------------------ manifest
def check_trailer(raw: bytes, check_digest: bool = True) -> str:
    """The manifest's self-checksum (§5.1): ``"ok"`` (verified), ``"unchecked"`` (present, not
    verified: ``check_digest=False``), or ``"none"`` (no trailer); raises if it is damaged."""
    tail = raw[-TRAILER_LEN:]
    if len(raw) < TRAILER_LEN or not (tail.startswith(TRAILER_KEY) and tail.endswith(TRAILER_END)):
        if b'"manifest_xxh3_128"' in raw:
            raise FormatError("manifest.json: its self-checksum trailer is damaged")
        return "none"
    if not check_digest:
        return "unchecked"
    if xxh3_128_hex(raw[:-TRAILER_LEN]).encode() != tail[len(TRAILER_KEY):len(TRAILER_KEY) + 32]:
        raise FormatError("manifest.json: checksum mismatch (the manifest itself was altered or damaged)")
    return "ok"


def parse_manifest(raw: bytes, check_digest: bool | None = None) -> tuple[dict[str, Any], str]:
    """Validate a manifest (§5, §11 steps 1-2); return the document and the trailer status.
    ``check_digest=None`` checks the trailer's digest if xxhash is installed."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError("manifest.json is implausibly large")
    trailer = check_trailer(raw, xxhash is not None if check_digest is None else check_digest)
    doc = parse_json(raw, MANIFEST)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise FormatError("manifest.json is not an unbroken manifest")
    version = doc.get("format_version")
    if not _is_int(version) or version < 1:
        raise FormatError(f"manifest.json has an invalid format_version {version!r}")
    if version >= 2 and trailer == "none":
        raise FormatError("manifest.json has no valid self-checksum trailer (damaged)")
    if version > KNOWN_FORMAT_VERSION:
        raise NewerFormatError(f"manifest.json: checkpoint format version {version} is newer than this reader "
                               f"knows ({KNOWN_FORMAT_VERSION}); use a newer reader")

    def bad(msg: str) -> FormatError:
        return FormatError(f"manifest.json is malformed ({msg})")

    files = doc.get("files")
    if not isinstance(files, dict):
        raise bad("files is not an object")
    for name, entry in files.items():
        check_name(name)
        if name == MANIFEST:
            raise FormatError("manifest.json lists itself")
        if not isinstance(entry, dict) or not _is_int(entry.get("size")) or entry["size"] < 0 \
                or not isinstance(entry.get("xxh3_128"), str) or not HEX128.fullmatch(entry["xxh3_128"]):
            raise bad(f"bad size or checksum for {name!r}")
    for k in ("step", "seq"):
        if not _is_int(doc.get(k)) or doc[k] < 0:
            raise bad("step and seq must be non-negative integers")
    if type(doc.get("created")) not in (int, float):
        raise bad("created must be a number")
    for k in ("metrics", "progress", "environment", "probe"):
        if not isinstance(doc.get(k, {}), dict):
            raise bad(f"{k} must be an object")
    for k, v in doc.get("probe", {}).items():
        if not (type(v) in (int, float) or v in ("nan", "inf", "-inf")):
            raise bad(f"probe {k!r} is not a number")
    tags = doc.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise bad("tags must be a list of strings")
    if not isinstance(doc.get("kind", "regular"), str):
        raise bad("kind must be a string")
    ws = doc.get("world_size", 1)
    if not _is_int(ws) or not 1 <= ws <= 1 << 20:
        raise bad("world_size must be a positive integer")
    if STATE_FILE not in files:
        raise FormatError(f"manifest.json does not list {STATE_FILE}")
    chunks = doc.get("chunks", {}) if version >= 3 else {}  # before 3: an unknown field, ignored
    if not isinstance(chunks, dict):
        raise bad("chunks is not an object")
    for cid, entry in chunks.items():
        if not CHUNK_ID.fullmatch(cid):
            raise bad(f"invalid chunk id {cid[:80]!r} (not 64 lowercase hex digits)")
        if not isinstance(entry, dict) or not _is_int(entry.get("size")) or entry["size"] < 0 \
                or not isinstance(entry.get("xxh3_128"), str) or not HEX128.fullmatch(entry["xxh3_128"]):
            raise bad(f"bad size or checksum for chunk {cid[:16]}")
    if sum(e["size"] for e in files.values()) + sum(e["size"] for e in chunks.values()) >= 2**63:
        raise bad("the files and chunks add up to more than 2**63 bytes")
    return doc, trailer


# ------------------------------------------------------------------------ the tree
class Decoder:
    """state-tree JSON nodes (§6) -> Python/numpy values; strict."""

    def __init__(self, ckpt: Checkpoint, fname: str, raw: bool, assemble: bool) -> None:
        self.ckpt, self.fname, self.raw, self.assemble = ckpt, fname, raw, assemble
        self.depth = 0

    def fail(self, msg: str) -> FormatError:
        return FormatError(f"{self.fname}: state tree: {msg}")

    def decode(self, node: Any) -> Any:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(f"nesting deeper than {MAX_DEPTH} levels")
        try:
            t = type(node)
            if node is None or t in (bool, int, float, str):
                return node
            if t is list:
                return [self.decode(v) for v in node]
            if t is not dict or TAG not in node:
                raise self.fail(f"untagged object {str(node)[:80]!r}")
            tag = node[TAG]
            handler = getattr(self, f"d_{tag}", None) if isinstance(tag, str) and tag.isidentifier() else None
            if handler is None:
                raise self.fail(f"unknown tag {tag!r}")
            return handler(node)
        except FormatError:
            raise
        except RecursionError:
            raise self.fail("nesting too deep") from None
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as e:
            raise self.fail(f"malformed node ({type(e).__name__}: {e})") from None
        finally:
            self.depth -= 1

    # field accessors
    def _list(self, x: Any) -> list:
        if type(x) is not list:
            raise self.fail(f"expected a list, got {type(x).__name__}")
        return x

    def _str(self, x: Any) -> str:
        if type(x) is not str:
            raise self.fail(f"expected a string, got {type(x).__name__}")
        return x

    def _np_dtype(self, s: Any, kinds: str) -> np.dtype:
        s = self._str(s)
        dt = np.dtype(s) if len(s) <= 8 else None
        if dt is None or dt.kind not in kinds or dt.fields is not None or dt.subdtype is not None:
            raise self.fail(f"numpy dtype {s!r} not allowed")
        return dt

    # tags
    def d_dict(self, n: dict) -> dict:
        out: dict = OrderedDict() if n.get("ordered") else {}
        if "v" in n:
            if type(n["v"]) is not dict:
                raise self.fail("dict node without an object")
            for k, v in n["v"].items():
                out[k] = self.decode(v)
        else:
            for pair in self._list(n["items"]):
                if type(pair) is not list or len(pair) != 2:
                    raise self.fail("dict item is not a [key, value] pair")
                out[_hashable(self.decode(pair[0]))] = self.decode(pair[1])
        if "meta" in n:
            meta = self.decode(n["meta"])
            if isinstance(out, OrderedDict):
                out._metadata = meta  # type: ignore[attr-defined]
        return out

    def d_tuple(self, n: dict) -> tuple:
        return tuple(self.decode(v) for v in self._list(n["v"]))

    def d_set(self, n: dict) -> set:
        return {_hashable(self.decode(v)) for v in self._list(n["v"])}

    def d_frozenset(self, n: dict) -> frozenset:
        return frozenset(_hashable(self.decode(v)) for v in self._list(n["v"]))

    def d_size(self, n: dict) -> TorchSize:
        dims = self._list(n["v"])
        if not all(_is_int(d) for d in dims):
            raise self.fail("torch.Size with a non-integer dimension")
        return TorchSize(dims)

    def d_int(self, n: dict) -> int:
        s = self._str(n["hex"])
        if not re.fullmatch(r"-?0x[0-9a-fA-F]+", s):
            raise self.fail(f"bad big integer {s[:40]!r}")
        return int(s, 16)

    def d_float(self, n: dict) -> float:
        v = n["v"]
        if v not in ("nan", "inf", "-inf"):
            raise self.fail(f"bad float {v!r}")
        if "bits" in n:
            raw = bytes.fromhex(self._str(n["bits"]))
            x = struct.unpack(">d", raw)[0] if len(raw) == 8 else 0.0
            if v != "nan" or x == x:
                raise self.fail(f"bad NaN bits {n['bits']!r}")
            return x
        return float(v)

    def d_complex(self, n: dict) -> complex:
        parts = self._list(n["v"])
        if len(parts) != 2:
            raise self.fail("complex needs [re, im]")
        re_, im = (self.decode(p) for p in parts)
        if type(re_) not in (int, float) or type(im) not in (int, float):
            raise self.fail("complex parts must be numbers")
        return complex(float(re_), float(im))

    def d_bytes(self, n: dict) -> bytes:
        try:
            return base64.b64decode(self._str(n["b64"]), validate=True)
        except ValueError as e:  # binascii.Error
            raise self.fail(f"bad base64 ({e})") from None

    def d_bytearray(self, n: dict) -> bytearray:
        return bytearray(self.d_bytes(n))

    def d_dtype(self, n: dict) -> TorchDtype:
        v = self._str(n["v"])
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", v):
            raise self.fail(f"unknown torch dtype {v!r}")
        return TorchDtype(v)

    def d_device(self, n: dict) -> TorchDevice:
        return TorchDevice(self._str(n["v"]))

    def d_np_dtype(self, n: dict) -> np.dtype:
        return self._np_dtype(n["v"], "biufcSU")

    def d_np_scalar(self, n: dict) -> np.generic:
        dt = self._np_dtype(n["dtype"], "biufc")
        raw = bytes.fromhex(self._str(n["hex"]))
        if len(raw) != dt.itemsize:
            raise self.fail("numpy scalar of the wrong size")
        return np.frombuffer(raw, dtype=dt)[0]

    def d_tensor(self, n: dict) -> np.ndarray:
        return self.ckpt._resolve(n, self.fname, self.raw)

    def d_ndarray(self, n: dict) -> np.ndarray:
        dt = self._np_dtype(n["dtype"], "biufc")
        info = self.ckpt._reference(n, self.fname)
        if DTYPES[info.dtype][2] is None:
            raise self.fail(f"array recorded as {dt} stored as {info.dtype}")
        arr = self.ckpt._resolve(n, self.fname, False)
        if arr.dtype.itemsize != dt.itemsize or arr.dtype.kind != dt.kind:
            raise self.fail(f"array stored as {arr.dtype} but recorded as {dt}")
        return arr.astype(dt, copy=False)

    def d_dtensor(self, n: dict) -> Any:
        fqn, shape = n.get("fqn"), n.get("shape")
        if not isinstance(fqn, str) or not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise self.fail("malformed sharded tensor reference")
        ref = ShardedRef(fqn, tuple(shape), str(n.get("dtype")))
        if not self.assemble:
            return ref
        meta = self.ckpt.sharded_metadata()["tensors"].get(fqn)
        if meta is None:
            raise FormatError(f"{SHARDED_FILE} has no tensor {fqn!r} (referenced by {self.fname})")
        if tuple(meta["size"]) != ref.shape or TORCH_NAMES.get(ref.dtype) != meta["dtype"]:
            raise self.fail(f"sharded tensor {fqn!r} is {ref.dtype} {list(ref.shape)} in the tree but "
                            f"{meta['dtype']} {meta['size']} in {SHARDED_FILE}")
        return self.ckpt.assemble(fqn, raw=self.raw)

    def d_torch_generator(self, n: dict) -> TorchGenerator:
        device = self._str(n["device"])
        state = self.decode(n["state"])
        if not isinstance(state, np.ndarray) or state.dtype != np.uint8 or state.ndim != 1:
            raise self.fail("torch generator state is not a uint8 vector")
        return TorchGenerator(device, state)

    def d_np_generator(self, n: dict) -> np.random.Generator:
        state = self.decode(n["state"])
        name = state.get("bit_generator") if isinstance(state, dict) else None
        if name not in NP_BITGENS or not hasattr(np.random, name):
            raise self.fail(f"unknown numpy bit generator {name!r}")
        bg = getattr(np.random, name)()
        bg.state = state
        return np.random.Generator(bg)

    def d_np_randomstate(self, n: dict) -> np.random.RandomState:
        rs = np.random.RandomState()
        rs.set_state(self.decode(n["state"]))
        return rs

    def d_py_random(self, n: dict) -> random.Random:
        def tuples(x: Any) -> Any:
            return tuple(tuples(v) for v in x) if isinstance(x, (list, tuple)) else x

        r = random.Random()
        r.setstate(tuples(self.decode(n["state"])))
        return r

    def d_path(self, n: dict) -> pathlib.PurePath:
        v = self._str(n["v"])
        return pathlib.PurePosixPath(v) if n.get("posix") else pathlib.PureWindowsPath(v)

    def d_stateful(self, n: dict) -> Stateful:
        return Stateful(self._str(n["class"]), self.decode(n["v"]))


# ----------------------------------------------------------------- the checkpoint
def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


class Checkpoint:
    """One checkpoint folder, opened for reading: the manifest is read and validated at once
    (its trailer digest too, if xxhash is installed); files are read on demand, each checked
    against its listed size, and parsed strictly. :meth:`verify` checks every checksum.

    Format 3: ``chunks`` is the run's chunk folder (default: ``chunks`` beside the checkpoint
    folder, ``<path>/../chunks``); a tensor file the manifest does not list is resolved
    through its chunk map (:attr:`chunk_maps`)."""

    def __init__(self, path: str | os.PathLike[str], chunks: str | os.PathLike[str] | None = None) -> None:
        p = pathlib.Path(path)
        if p.name == MANIFEST and p.is_file():
            p = p.parent
        self.path = p
        if not p.is_dir():
            raise FormatError(f"{p}: not a checkpoint folder")
        raw = self._read_bytes(MANIFEST, None)
        self.manifest_bytes = bytes(raw)
        self.manifest, self.trailer = parse_manifest(self.manifest_bytes)
        self.format_version: int = self.manifest["format_version"]
        self.world_size: int = self.manifest.get("world_size", 1)
        self.files: dict[str, dict[str, Any]] = self.manifest["files"]
        self.chunks: dict[str, dict[str, Any]] = self.manifest.get("chunks", {}) if self.format_version >= 3 else {}
        self.chunks_path = pathlib.Path(chunks) if chunks is not None else \
            pathlib.Path(os.path.abspath(p)).parent / CHUNKS_DIR
        self.chunk_maps: dict[str, str] = {}  # format 3: tensor file -> the chunk map standing for it
        if self.format_version >= 3:
            for name in self.files:
                if name.endswith(CHUNKMAP_SUFFIX):
                    tensor_file = name[:-len(CHUNKMAP_SUFFIX)] + TENSOR_SUFFIX
                    if tensor_file in self.files:
                        raise FormatError(f"manifest.json lists both {tensor_file} and its chunk map {name}")
                    self.chunk_maps[tensor_file] = name
        self._maps: dict[str, Any] = {}
        self._chunk_data: dict[str, Any] = {}
        self.verified_chunks: set[str] = set()
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._trees: dict[str, Any] = {}
        self._arrays: dict[tuple[str, str, bool, bool], np.ndarray] = {}
        self._sharded: dict[str, Any] | None = None
        self._assembled: dict[tuple[str, bool], np.ndarray] = {}
        self.verified: set[str] = set()

    # ---------------------------------------------------------------- raw files
    def _read_bytes(self, name: str, size: int | None, folder: pathlib.Path | None = None,
                    label: str | None = None) -> Any:
        """A file of the checkpoint (or of ``folder``: the chunk folder), mapped read-only: never
        through a symbolic link, a regular file only, with exactly ``size`` bytes (if given)."""
        folder = self.path if folder is None else folder
        label = label or name
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            if os.open in os.supports_dir_fd:
                dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
                try:
                    fd = os.open(name, flags, dir_fd=dfd)
                finally:
                    os.close(dfd)
            else:
                fd = os.open(folder / name, flags)
        except FileNotFoundError:
            where = f" from {folder}" if folder != self.path else ""
            raise FormatError(f"{label} is missing{where}") from None
        except OSError as e:
            raise FormatError(f"{label} cannot be opened ({e.strerror or e}); a symbolic link?") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{label} is not a regular file")
            if size is None and st.st_size > MAX_MANIFEST_BYTES:
                raise FormatError(f"{label} is implausibly large ({st.st_size} bytes)")
            if size is not None and st.st_size != size:
                raise FormatError(f"{label} has {st.st_size} bytes, the manifest says {size}")
            if st.st_size == 0:
                return b""
            return mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def data(self, name: str) -> Any:
        """The bytes of a listed file (mapped; checked against the listed size)."""
        if name not in self.files:
            raise FormatError(f"reference to unlisted file {name!r}")
        if name not in self._maps:
            self._maps[name] = self._read_bytes(check_name(name), self.files[name]["size"])
        return self._maps[name]

    def chunk_data(self, cid: str) -> Any:
        """Format 3: the bytes of a chunk the manifest lists, from the chunk folder (mapped;
        checked against the listed size)."""
        if cid not in self.chunks:
            raise FormatError(f"reference to unlisted chunk {str(cid)[:80]!r}")
        if cid not in self._chunk_data:
            if not CHUNK_ID.fullmatch(cid):  # parse_manifest checked it: never a path
                raise FormatError(f"invalid chunk id {cid[:80]!r}")
            self._chunk_data[cid] = self._read_bytes(cid, self.chunks[cid]["size"], self.chunks_path,
                                                     f"chunk {cid}")
        return self._chunk_data[cid]

    def verify_chunk(self, cid: str) -> None:
        """Size and XXH3-128 of one listed chunk against the manifest, and its SHA-256 against
        its id (FormatError naming it)."""
        if cid in self.verified_chunks:
            return
        buf = self.chunk_data(cid)
        digest = _hash_buffer(buf)
        if digest != self.chunks[cid]["xxh3_128"]:
            raise FormatError(f"chunk {cid}: checksum mismatch (the chunk was altered or damaged; every "
                              f"checkpoint that uses it is invalid): xxh3_128 {digest}, the manifest says "
                              f"{self.chunks[cid]['xxh3_128']}")
        sha = hashlib.sha256()
        mv = memoryview(buf)
        for i in range(0, len(mv), _CHUNK):
            sha.update(mv[i:i + _CHUNK])
        if sha.hexdigest() != cid:
            raise FormatError(f"chunk {cid}: its SHA-256 is {sha.hexdigest()}, not its id")
        self.verified_chunks.add(cid)

    def verify_file(self, name: str) -> None:
        """Size and XXH3-128 of one listed file against the manifest (FormatError naming it)."""
        if name in self.verified:
            return
        digest = _hash_buffer(self.data(name))
        if digest != self.files[name]["xxh3_128"]:
            raise FormatError(f"{name}: checksum mismatch (the file was altered or damaged): "
                              f"xxh3_128 {digest}, the manifest says {self.files[name]['xxh3_128']}")
        self.verified.add(name)

    def verify(self) -> list[str]:
        """Check the manifest trailer (format 2) and every listed file's size and checksum (format
        3: and every listed chunk's, and that its SHA-256 is its id). Returns the problems found
        (empty: all fine); :class:`NeedsXxhash` without xxhash."""
        if xxhash is None:
            raise NeedsXxhash("--verify needs the xxhash package (pip install xxhash)")
        problems = []
        try:
            self.trailer = check_trailer(self.manifest_bytes, True)
        except FormatError as e:
            problems.append(str(e))
        for name in sorted(self.files):
            try:
                self.verify_file(name)
            except FormatError as e:
                problems.append(str(e))
        for cid in sorted(self.chunks):
            try:
                self.verify_chunk(cid)
            except FormatError as e:
                problems.append(str(e))
        return problems

    # ------------------------------------------------------------------ tensors
    def is_tensor_file(self, fname: Any) -> bool:
        """True for a name a tensor reference may use: a listed file, or (format 3) a tensor file
        whose chunk map is listed."""
        return isinstance(fname, str) and (fname in self.files or fname in self.chunk_maps)

    def tensor_files(self) -> list[str]:
        """Every tensor file of the checkpoint, written or standing as a chunk map, sorted."""
        return sorted([f for f in self.files if f.endswith(TENSOR_SUFFIX)] + list(self.chunk_maps))

    def header(self, fname: str) -> dict[str, TensorInfo]:
        """The validated tensor table of a listed safetensors file, or (format 3) of the tensor
        file a listed chunk map stands for."""
        if not fname.endswith(TENSOR_SUFFIX):
            raise FormatError(f"tensor reference to non-tensor file {fname!r}")
        if fname not in self._headers:
            if fname in self.chunk_maps:
                mname = self.chunk_maps[fname]
                self._headers[fname] = parse_chunk_map(self.data(mname), mname, fname, self.chunks)
            else:
                self._headers[fname] = parse_safetensors_header(self.data(fname), fname)
        return self._headers[fname]

    def tensor_info(self, fname: str, key: str) -> TensorInfo:
        table = self.header(fname)
        if key not in table:
            raise FormatError(f"{fname} has no tensor {key!r}")
        return table[key]

    def stored(self, fname: str, key: str) -> np.ndarray:
        """A tensor's stored bits as a numpy array (a copy): BF16 as uint16, float8 as uint8."""
        info = self.tensor_info(fname, key)
        np_dt = np.dtype(DTYPES[info.dtype][0])
        buf = self.chunk_data(info.chunk) if info.chunk is not None else self.data(fname)
        count = (info.end - info.begin) // np_dt.itemsize
        arr = np.frombuffer(buf, dtype=np_dt, count=count, offset=info.begin) if count else np.empty(0, np_dt)
        return arr.reshape(info.shape).astype(np_dt.newbyteorder("="), copy=True)

    def tensor(self, fname: str, key: str, raw: bool = False, complex_: bool = False) -> np.ndarray:
        """A tensor as numpy values (BF16/F8 as exact float32 unless ``raw``); ``complex_``: the
        stored tensor is the real view of a complex one (trailing dimension 2)."""
        ck = (fname, key, raw, complex_)
        if ck in self._arrays:
            return self._arrays[ck]
        info = self.tensor_info(fname, key)
        arr = self.stored(fname, key)
        if complex_:
            if info.dtype not in ("F16", "F32", "F64") or not info.shape or info.shape[-1] != 2:
                raise FormatError(f"{fname}: tensor {key!r} ({info.dtype} {list(info.shape)}) cannot be "
                                  "the real view of a complex tensor")
            if info.dtype == "F16":
                arr = arr.astype(np.float32)
            arr = np.ascontiguousarray(arr).view(np.complex64 if arr.dtype == np.float32 else np.complex128)
            arr = arr.reshape(info.shape[:-1])
        elif not (raw and DTYPES[info.dtype][2] is None):
            arr = to_value(arr, info.dtype)
        self._arrays[ck] = arr
        return arr

    def _reference(self, ref: dict[str, Any], where: str) -> TensorInfo:
        fname, key = ref.get("file"), ref.get("key")
        if not self.is_tensor_file(fname):
            raise FormatError(f"{where}: tensor reference to unlisted file {fname!r}")
        if not isinstance(key, str):
            raise FormatError(f"{where}: tensor reference with a bad key {key!r}")
        return self.tensor_info(fname, key)

    def _resolve(self, ref: dict[str, Any], where: str, raw: bool) -> np.ndarray:
        info = self._reference(ref, where)
        return self.tensor(info.file, info.key, raw=raw, complex_=bool(ref.get("complex")))

    # ------------------------------------------------------------------ sharded
    def sharded_metadata(self) -> dict[str, Any]:
        """``sharded.json``, validated (§9): ``{"tensors": {fqn: {dtype, size, chunks}},
        "storage": {(fqn, offsets): (file, key)}}``."""
        if self._sharded is not None:
            return self._sharded
        if SHARDED_FILE not in self.files:
            raise FormatError(f"the checkpoint has sharded tensors but the manifest does not list {SHARDED_FILE}")
        doc = parse_json(self.data(SHARDED_FILE), SHARDED_FILE)

        def ints(x: Any, what: str) -> list[int]:
            if not isinstance(x, list) or len(x) > MAX_DIMS or not all(_is_int(v) and 0 <= v < 1 << 62 for v in x):
                raise FormatError(f"{SHARDED_FILE}: bad {what} {str(x)[:80]}")
            return x

        if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), dict) \
                or not isinstance(doc.get("storage"), list):
            raise FormatError(f"{SHARDED_FILE} is malformed (needs tensors and storage)")
        tensors = {}
        for fqn, t in doc["tensors"].items():
            if not isinstance(t, dict) or t.get("dtype") not in DTYPES or not isinstance(t.get("chunks"), list):
                raise FormatError(f"{SHARDED_FILE}: tensor {fqn!r} is malformed")
            size = ints(t.get("size"), "size")
            chunks = []
            for c in t["chunks"]:
                if not isinstance(c, dict):
                    raise FormatError(f"{SHARDED_FILE}: a chunk of {fqn!r} is malformed")
                off, sz = ints(c.get("offsets"), "offsets"), ints(c.get("sizes"), "sizes")
                if len(off) != len(size) or len(sz) != len(size) \
                        or any(o + s > n for o, s, n in zip(off, sz, size, strict=True)):
                    raise FormatError(f"{SHARDED_FILE}: chunk {c} outside {fqn} {size}")
                chunks.append((tuple(off), tuple(sz)))
            tensors[fqn] = {"dtype": t["dtype"], "size": size, "chunks": chunks}
        storage = {}
        for s in doc["storage"]:
            if not isinstance(s, dict) or not isinstance(s.get("fqn"), str) or not isinstance(s.get("key"), str) \
                    or not isinstance(s.get("file"), str):
                raise FormatError(f"{SHARDED_FILE}: malformed storage entry {str(s)[:80]}")
            if not self.is_tensor_file(s["file"]):
                raise FormatError(f"{SHARDED_FILE} refers to unlisted file {s['file']!r}")
            off = None if s.get("offset") is None else tuple(ints(s["offset"], "offset"))
            storage[(s["fqn"], off)] = (s["file"], s["key"])
        self._sharded = {"tensors": tensors, "storage": storage}
        return self._sharded

    def assemble(self, fqn: str, raw: bool = False) -> np.ndarray:
        """The full tensor ``fqn`` from its pieces; the chunks must tile it exactly."""
        if (fqn, raw) in self._assembled:
            return self._assembled[(fqn, raw)]
        md = self.sharded_metadata()
        meta = md["tensors"].get(fqn)
        if meta is None:
            raise FormatError(f"{SHARDED_FILE} has no tensor {fqn!r}")
        size, st = meta["size"], meta["dtype"]
        pieces = []
        covered = 0
        for off, sz in meta["chunks"]:
            where = md["storage"].get((fqn, off))
            if where is None:
                raise FormatError(f"{SHARDED_FILE}: no stored piece of {fqn} at {list(off)}")
            info = self.tensor_info(*where)
            if info.shape != sz or info.dtype != st:
                raise FormatError(f"{where[0]}: piece {where[1]!r} of {fqn} is {info.dtype} {list(info.shape)}, "
                                  f"expected {st} {list(sz)}")
            pieces.append((off, sz, where))
            covered += _numel(sz)
        for i, (oa, sa, _) in enumerate(pieces):  # no two chunks overlap ...
            for ob, sb, _ in pieces[i + 1:]:
                if _numel(sa) and _numel(sb) and all(a < b + m and b < a + n
                                                     for a, n, b, m in zip(oa, sa, ob, sb, strict=True)):
                    raise FormatError(f"{SHARDED_FILE}: chunks of {fqn} at {list(oa)} and {list(ob)} overlap")
        if covered != _numel(size):  # ... and together they cover it: an exact tiling
            raise FormatError(f"{SHARDED_FILE}: the pieces of {fqn} cover {covered} of {_numel(size)} elements")
        out = np.empty(size, dtype=np.dtype(DTYPES[st][0]).newbyteorder("="))
        for off, sz, (fname, key) in pieces:
            out[tuple(slice(o, o + s) for o, s in zip(off, sz, strict=True))] = self.stored(fname, key)
        result = out if raw and DTYPES[st][2] is None else to_value(out, st)
        self._assembled[(fqn, raw)] = result
        return result

    # -------------------------------------------------------------------- trees
    def tree_json(self, fname: str) -> dict[str, Any]:
        """The raw JSON of a state tree file (``{"state": {...}}``)."""
        if fname not in self._trees:
            doc = parse_json(self.data(fname), fname)
            if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict):
                raise FormatError(f"{fname} has no state")
            self._trees[fname] = doc
        return self._trees[fname]

    def decode(self, fname: str, raw: bool = False, assemble: bool = True) -> dict[str, Any]:
        tree = self.tree_json(fname)
        return Decoder(self, fname, raw, assemble).decode({TAG: "dict", "v": tree["state"]})

    def state(self, raw: bool = False, assemble: bool = True) -> dict[str, Any]:
        """The shared state tree (``state.json``), decoded; ``Stateful`` kept as :class:`Stateful`."""
        return self.decode(STATE_FILE, raw, assemble)

    def ranks(self) -> list[int]:
        """Ranks whose part (``rank-<r>.json``) the checkpoint holds."""
        return [r for r in range(self.world_size) if rank_file(r) in self.files]

    def rank_state(self, rank: int, raw: bool = False) -> dict[str, Any] | None:
        """Rank ``rank``'s tree (``{"state": PerRank objects, "rng": ...}``), or None."""
        fname = rank_file(rank)
        return self.decode(fname, raw) if fname in self.files else None

    def tree_files(self) -> list[str]:
        return [STATE_FILE] + [rank_file(r) for r in self.ranks()]

    def complex_refs(self) -> set[tuple[str, str]]:
        """``(file, key)`` of every stored tensor that is the real view of a complex one."""
        out: set[tuple[str, str]] = set()

        def walk(node: Any, depth: int) -> None:
            if depth > MAX_DEPTH:
                raise FormatError("state tree: nesting too deep")
            if isinstance(node, list):
                for v in node:
                    walk(v, depth + 1)
            elif isinstance(node, dict):
                if node.get(TAG) in ("tensor", "ndarray") and node.get("complex"):
                    out.add((node.get("file"), node.get("key")))
                for v in node.values():
                    walk(v, depth + 1)

        for f in self.tree_files():
            walk(self.tree_json(f)["state"], 0)
        return out

    def find_tensor(self, name: str) -> tuple[str, str | None, str]:
        """Resolve a CLI tensor name: ``("sharded", None, fqn)`` or ``("file", fname, key)``.
        KeyError (with candidates) if it is unknown or ambiguous."""
        if SHARDED_FILE in self.files and name in self.sharded_metadata()["tensors"]:
            return "sharded", None, name
        hits = [(f, name) for f in self.tensor_files() if name in self.header(f)]
        if not hits and ":" in name:
            f, _, key = name.partition(":")
            if f in self.tensor_files() and key in self.header(f):
                hits = [(f, key)]
        if len(hits) == 1:
            return "file", hits[0][0], hits[0][1]
        if hits:
            raise KeyError(f"tensor {name!r} is in several files; name one as FILE:KEY: "
                           + ", ".join(f"{f}:{k}" for f, k in hits))
        raise KeyError(f"no tensor {name!r} in {self.path}")


def open_checkpoint(path: str | os.PathLike[str], chunks: str | os.PathLike[str] | None = None) -> Checkpoint:
    """Open a checkpoint folder (manifest read and validated); ``chunks``: the run's chunk folder
    if not ``<path>/../chunks`` (format 3)."""
    return Checkpoint(path, chunks)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The validated manifest of a checkpoint folder."""
    return Checkpoint(path).manifest


def verify_checkpoint(path: str | os.PathLike[str], chunks: str | os.PathLike[str] | None = None) -> list[str]:
    """Every problem ``--verify`` finds (empty: the checkpoint is intact)."""
    return Checkpoint(path, chunks).verify()


def read_checkpoint(path: str | os.PathLike[str], *, verify: bool = False, raw: bool = False,
                    assemble: bool = True, keep_stateful: bool = False,
                    chunks: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The decoded shared state of a checkpoint, like ``unbroken.load(path)``: numpy arrays for
    tensors (BF16/F8 as exact float32, or their bits with ``raw=True``), sharded tensors
    assembled, ``Stateful`` objects as their state (``keep_stateful=True``: as :class:`Stateful`).
    With ``verify``, every file's checksum is checked first (FormatError listing the problems).
    ``chunks``: the run's chunk folder if not ``<path>/../chunks`` (format 3)."""
    ck = Checkpoint(path, chunks)
    if verify:
        problems = ck.verify()
        if problems:
            raise FormatError("; ".join(problems))
    tree = ck.state(raw=raw, assemble=assemble)
    return tree if keep_stateful else unwrap(tree)


# ------------------------------------------------------------------ rendering
def _short(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n - 3] + "..."


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


class Renderer:
    """A readable rendering of a state tree's JSON (tensor data is not read, headers are)."""

    MAX_INLINE = 8

    def __init__(self, ck: Checkpoint, fname: str) -> None:
        self.ck, self.fname = ck, fname
        self.lines: list[str] = []

    def leaf(self, node: Any) -> str | None:
        """A one-line rendering of a leaf node, or None for a container."""
        t = type(node)
        if node is None or t in (bool, int, float):
            return repr(node)
        if t is str:
            return repr(_short(node))
        if t is list:
            return None
        if t is not dict:
            raise FormatError(f"{self.fname}: state tree: untagged value {str(node)[:60]!r}")
        tag = node.get(TAG)
        if tag in ("float", "int", "complex", "bytes", "bytearray", "np_scalar", "np_dtype", "path", "dtype",
                   "device", "size"):
            value = Decoder(self.ck, self.fname, False, False).decode(node)
            if tag == "int":
                return f"int ({value.bit_length()} bits) {_short(hex(value), 40)}"
            if tag in ("bytes", "bytearray"):
                return f"{tag} ({len(value)}) {_short(repr(bytes(value)), 60)}"
            if tag == "np_scalar":
                return repr(value)
            if tag == "np_dtype":
                return f"np.dtype({value.str!r})"
            if tag == "float" and "bits" in node:
                return f"nan (bits {node['bits']})"
            return repr(value)
        if tag in ("tensor", "ndarray"):
            info = self.ck._reference(node, self.fname)
            shape = list(info.shape)
            if node.get("complex"):
                kind = {"F16": "complex32", "F32": "complex64", "F64": "complex128"}.get(info.dtype, "complex?")
                what = f"{kind} {shape[:-1]} (stored {info.dtype} {shape})"
            else:
                what = f"{info.dtype} {shape}"
            extra = ""
            if tag == "tensor":
                extra = f" {node.get('device', '?')}" + (" requires_grad" if node.get("requires_grad") else "")
            else:
                extra = f" numpy {node.get('dtype')}"
            chunk = f" (chunk {info.chunk[:16]})" if info.chunk is not None else ""
            return f"{tag} {what}{extra}  @ {info.file}:{info.key}{chunk}"
        if tag == "dtensor":
            md = self.ck.sharded_metadata()["tensors"].get(node.get("fqn"))
            if md is None:
                raise FormatError(f"{SHARDED_FILE} has no tensor {node.get('fqn')!r}")
            files = sorted({self.ck.sharded_metadata()["storage"].get((node["fqn"], off), ("?",))[0]
                            for off, _ in md["chunks"]})
            return (f"dtensor {node.get('dtype')} {node.get('shape')}  sharded: fqn {node['fqn']!r}, "
                    f"{len(md['chunks'])} chunks in {', '.join(files)}")
        if tag == "np_generator":
            st = node.get("state")
            v = st.get("v") if isinstance(st, dict) else None
            return f"numpy Generator ({v.get('bit_generator') if isinstance(v, dict) else '?'})"
        if tag == "np_randomstate":
            return "numpy RandomState (MT19937)"
        if tag == "py_random":
            return "random.Random"
        if tag == "torch_generator":
            st = node.get("state")
            where = ""
            if isinstance(st, dict) and st.get(TAG) == "tensor":
                info = self.ck._reference(st, self.fname)
                where = f" (state {info.dtype} {list(info.shape)} @ {info.file}:{info.key})"
            return f"torch.Generator {node.get('device')}{where}"
        return None

    def container(self, node: Any) -> tuple[str, list[tuple[str, Any]], bool]:
        """Summary, children and whether it is a mapping, of a container node."""
        if type(node) is list:
            return f"list ({len(node)} items)", [(f"[{i}]", v) for i, v in enumerate(node)], False
        tag = node.get(TAG)
        if tag == "stateful":
            summary, children, is_map = self.container_or_leaf(node.get("v"))
            return f"<{node.get('class')}> {summary}", children, is_map
        if tag == "dict":
            kind = "OrderedDict" if node.get("ordered") else "dict"
            meta = ", with _metadata" if "meta" in node else ""
            if isinstance(node.get("v"), dict):
                items = [(str(k), v) for k, v in node["v"].items()]
            else:
                items = []
                for pair in node.get("items", []):
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise FormatError(f"{self.fname}: state tree: bad dict item")
                    items.append((self.key_text(pair[0]), pair[1]))
            return f"{kind} ({len(items)} items{meta})", items, True
        if tag in ("tuple", "set", "frozenset"):
            v = node.get("v")
            if not isinstance(v, list):
                raise FormatError(f"{self.fname}: state tree: malformed {tag}")
            return f"{tag} ({len(v)} items)", [(f"[{i}]", x) for i, x in enumerate(v)], False
        raise FormatError(f"{self.fname}: state tree: unknown tag {tag!r}")

    def container_or_leaf(self, node: Any) -> tuple[str, list[tuple[str, Any]], bool]:
        leaf = self.leaf(node)
        return (leaf, [], False) if leaf is not None else self.container(node)

    def describe(self, node: Any) -> tuple[str, list[tuple[str, Any]]]:
        """One line for ``node`` and the children to render below it. Containers of short leaves
        (no tensors) are shown inline: a mapping of at most 6 items, a sequence's first 8 items."""
        summary, children, is_map = self.container_or_leaf(node)
        if not children:
            return summary, []
        if any(isinstance(v, dict) and v.get(TAG) in ("tensor", "ndarray", "dtensor", "torch_generator")
               for _, v in children):
            return summary, children
        shown = children if is_map else children[: self.MAX_INLINE]
        if is_map and len(children) > 6:
            return summary, children
        leaves = [self.leaf(v) for _, v in shown]
        if not all(x is not None and len(x) < 40 for x in leaves):
            return summary, children
        if not is_map and any(type(v) in (list, dict) and self.leaf(v) is None for _, v in children[len(shown):]):
            return summary, children
        if is_map:
            text = ", ".join(f"{k}: {x}" for (k, _), x in zip(shown, leaves, strict=True))
            return (f"{summary}: {{{text}}}", []) if len(text) <= 100 else (summary, children)
        more = ", ..." if len(children) > len(shown) else ""
        return f"{summary}: [{', '.join(leaves)}{more}]", []  # type: ignore[arg-type]

    def key_text(self, node: Any) -> str:
        """A non-string dict key, as Python would print it."""
        try:
            return _short(repr(Decoder(self.ck, self.fname, False, False).decode(node)), 60)
        except FormatError:
            return "<key>"

    def render(self, label: str, node: Any, indent: int = 0, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise FormatError(f"{self.fname}: state tree: nesting too deep")
        summary, children = self.describe(node)
        self.lines.append(f"{'  ' * indent}{label}: {summary}")
        for k, v in children:
            self.render(k, v, indent + 1, depth + 1)


def render_tree(ck: Checkpoint, fname: str) -> list[str]:
    r = Renderer(ck, fname)
    for key, node in ck.tree_json(fname)["state"].items():
        r.render(key, node, 1)
    return r.lines


def summary_lines(ck: Checkpoint) -> list[str]:
    m = ck.manifest
    trailer = {"ok": "self-checksum ok", "unchecked": "self-checksum present (not checked: no xxhash)",
               "none": "no self-checksum (format 1)"}[ck.trailer]
    try:
        created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m["created"]))
    except (OverflowError, OSError, ValueError):
        created = repr(m["created"])
    lines = [
        f"checkpoint: {ck.path}",
        f"format: {m['format']} version {ck.format_version} ({trailer})",
        f"step: {m['step']}  seq: {m['seq']}  kind: {m.get('kind', 'regular')}  world size: {ck.world_size}",
        f"created: {created}",
    ]
    if m.get("tags"):
        lines.append(f"tags: {', '.join(m['tags'])}")
    if m.get("metrics"):
        lines.append("metrics: " + ", ".join(f"{k}={v!r}" for k, v in m["metrics"].items()))
    if m.get("progress"):
        lines.append("progress: " + ", ".join(f"{k}={v}" for k, v in m["progress"].items()))
    if m.get("probe"):
        lines.append("probe: " + ", ".join(f"{k}={v!r}" for k, v in m["probe"].items()))
    env = m.get("environment") or {}
    if env:
        lines.append("written by: " + ", ".join(f"{k} {env[k]}" for k in ("unbroken", "torch", "python", "host")
                                                if env.get(k) is not None))
    total = sum(f["size"] for f in ck.files.values())
    lines.append(f"files: {len(ck.files)} ({_fmt_bytes(total)}) + manifest.json")
    for name in sorted(ck.files):
        f = ck.files[name]
        lines.append(f"  {f['size']:>12}  {f['xxh3_128']}  {name}")
    if ck.format_version >= 3:
        total = sum(c["size"] for c in ck.chunks.values())
        lines.append(f"chunks: {len(ck.chunks)} ({_fmt_bytes(total)}) in {ck.chunks_path}")
        for cid in sorted(ck.chunks):
            c = ck.chunks[cid]
            lines.append(f"  {c['size']:>12}  {c['xxh3_128']}  {cid}")
    return lines


def tensor_report(ck: Checkpoint, name: str, count: int = 8) -> list[str]:
    kind, fname, key = ck.find_tensor(name)
    if kind == "sharded":
        meta = ck.sharded_metadata()["tensors"][key]
        st = meta["dtype"]
        arr = ck.assemble(key)
        lines = [f"name: {key}", f"source: sharded, assembled from {len(meta['chunks'])} chunks"]
    else:
        assert fname is not None
        info = ck.tensor_info(fname, key)
        st = info.dtype
        is_complex = (fname, key) in ck.complex_refs()
        arr = ck.tensor(fname, key, complex_=is_complex)
        lines = [f"name: {key}", f"source: {fname}"]
        if info.chunk is not None:
            lines.append(f"chunk: {info.chunk} (through {ck.chunk_maps[fname]})")
        if is_complex:
            lines.append(f"stored: {st} {list(info.shape)} (the real view of a complex tensor)")
    note = " (converted exactly to float32)" if DTYPES[st][2] is None else ""
    lines += [f"dtype: {st}{note}", f"numpy: {arr.dtype}", f"shape: {list(arr.shape)}", f"elements: {arr.size}"]
    flat = arr.reshape(-1)
    more = f" (first {count} of {flat.size})" if flat.size > count else ""
    lines.append(f"values: {flat[:count].tolist()!r}{more}")
    if arr.dtype.kind == "b":
        lines.append(f"true: {int(flat.sum())}")
    elif arr.dtype.kind in "iuf" and flat.size:
        vals = flat
        if arr.dtype.kind == "f":
            nan = int(np.isnan(flat).sum())
            if nan:
                lines.append(f"nan: {nan}")
            vals = flat[~np.isnan(flat)]
        if vals.size:
            mean = float(np.mean(vals, dtype=np.float64))
            lines += [f"min: {vals.min().item()!r}", f"max: {vals.max().item()!r}", f"mean: {mean!r}"]
    elif arr.dtype.kind == "c" and flat.size:
        lines.append(f"mean: {complex(np.mean(flat.astype(np.complex128)))!r}")
    return lines


# ------------------------------------------------------------------------ the CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="unbroken_reader",
        description="Read an unbroken checkpoint without unbroken or torch (see docs/format.md).")
    p.add_argument("checkpoint", help="a checkpoint folder (the one holding manifest.json)")
    p.add_argument("--verify", action="store_true",
                   help="check the manifest's self-checksum and every file's size and xxh3-128 checksum")
    p.add_argument("--tensor", metavar="NAME",
                   help="show one tensor: its key in a safetensors file, FILE:KEY, or a sharded tensor's fqn")
    p.add_argument("--values", type=int, default=8, metavar="N", help="how many values --tensor prints")
    p.add_argument("--chunks", metavar="DIR",
                   help="format 3: the run's chunk folder (default: 'chunks' beside the checkpoint folder)")
    args = p.parse_args(argv)
    out = sys.stdout
    try:
        ck = Checkpoint(args.checkpoint, args.chunks)
        if args.verify:
            problems = ck.verify()
            if problems:
                for msg in problems:
                    print(f"BAD: {msg}", file=sys.stderr)
                print(f"verification FAILED: {len(problems)} problem(s) in {ck.path}", file=sys.stderr)
                return 1
            trailer = "self-checksum ok" if ck.trailer == "ok" else "format 1: no self-checksum"
            if ck.format_version >= 3:
                print(f"verified: manifest.json ({trailer}), {len(ck.files)} files and {len(ck.chunks)} chunks "
                      "(sizes and xxh3-128 checksums; chunk ids = SHA-256)", file=out)
            else:
                print(f"verified: manifest.json ({trailer}) and {len(ck.files)} files (sizes and xxh3-128 "
                      "checksums)", file=out)
        if args.tensor is not None:
            try:
                lines = tensor_report(ck, args.tensor, args.values)
            except KeyError as e:
                print(f"error: {e.args[0]}", file=sys.stderr)
                return 2
            print("\n".join(lines), file=out)
            return 0
        print("\n".join(summary_lines(ck)), file=out)
        for fname in ck.tree_files():
            rank = "" if fname == STATE_FILE else f" (rank {int(fname[5:10])})"
            print(f"\n{fname}{rank}:", file=out)
            print("\n".join(render_tree(ck, fname)), file=out)
    except NeedsXxhash as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NewerFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except FormatError as e:
        print(f"INVALID checkpoint {args.checkpoint}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)
