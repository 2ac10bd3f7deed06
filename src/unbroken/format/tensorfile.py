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
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable

import torch

from ..errors import CorruptCheckpointError
from .manifest import strict_object

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}
MAX_HEADER = 100 * 1024 * 1024
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
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


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


def parse_header(buf: memoryview, name: str) -> tuple[dict[str, dict[str, Any]], int]:
    """Validate a safetensors header; return the tensor table and where data starts.

    Every size is checked against the buffer before anything is allocated: a header
    longer than the file, offsets outside it, shapes whose byte count does not match
    their offsets, holes or overlaps, unknown dtypes and duplicate keys are rejected.
    """
    if len(buf) < 8:
        raise _bad(name, "file shorter than a safetensors header")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER or n > len(buf) - 8:
        raise _bad(name, f"header claims {n} bytes but the file has {len(buf)}")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"), object_pairs_hook=strict_object)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurd nesting
        raise _bad(name, f"unreadable header ({e})") from None
    if not isinstance(header, dict):
        raise _bad(name, "header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = len(buf) - 8 - n
    spans = []
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(name, f"tensor {key!r}: malformed entry")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ST_TO_DTYPE:
            raise _bad(name, f"tensor {key!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
            raise _bad(name, f"tensor {key!r}: bad shape {str(shape)[:80]}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise _bad(name, f"tensor {key!r}: bad data_offsets {offs!r}")
        begin, end = offs
        numel = 0 if 0 in shape else 1
        for d in shape:  # stop once it cannot fit: a million-dim shape must not cost minutes
            if numel > data_len:
                break
            numel *= d
        nbytes = numel * torch.empty((), dtype=ST_TO_DTYPE[dtype]).element_size()
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise _bad(name, f"tensor {key!r}: shape {str(shape)[:80]} {dtype} does not fit bytes [{begin}, {end}) "
                             f"of a {data_len}-byte data section")
        spans.append((begin, end))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            raise _bad(name, "tensor data has holes or overlaps")
        pos = end
    if pos != data_len:
        raise _bad(name, f"{data_len - pos} trailing bytes after the last tensor")
    return header, 8 + n


def load_tensor_file(buf: Any, name: str) -> dict[str, torch.Tensor]:
    """Parse a validated safetensors buffer into CPU tensors that share ``buf``'s memory."""
    header, start = parse_header(memoryview(buf), name)
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        dtype = ST_TO_DTYPE[info["dtype"]]
        begin, end = info["data_offsets"]
        if end == begin:
            out[key] = torch.empty(info["shape"], dtype=dtype)
            continue
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (start + begin) % itemsize:
            # Written by another tool without our alignment: copy to an aligned buffer.
            t = torch.frombuffer(bytearray(buf[start + begin : start + end]), dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype, count=(end - begin) // itemsize, offset=start + begin)
        out[key] = t.reshape(info["shape"])
    return out
