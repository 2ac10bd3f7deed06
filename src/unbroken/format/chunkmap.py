"""Chunk maps: which content-addressed chunk holds each tensor of an incremental checkpoint.

In an incremental checkpoint (format version 3) a tensor file ``tNN-<key>.safetensors`` is
not written; the checkpoint holds its *chunk map* ``tNN-<key>.chunks.json`` instead, a
verified file of the checkpoint like any other::

    {"format": "unbroken-chunkmap", "tensors": {"<key>": {"dtype": "F32", "shape": [4, 8],
                                                          "chunk": "<64 hex digits>"}, ...}}

Each chunk is the raw bytes of one tensor (C order, little-endian, no header), named by the
SHA-256 of those bytes, stored once per run in ``chunks/`` and listed in the manifest with
its size and xxh3-128 checksum. The state tree keeps referring to
``tNN-<key>.safetensors``; the reader finds the map by name (:func:`map_name`).

A map comes from disk, so it is trusted for nothing: every dtype, shape and id is checked,
the tensor's byte size must equal the chunk's recorded size, and the entry count is bounded.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .manifest import CHUNK_PREFIX, FileEntry, check_chunk_id, strict_object
from .tensorfile import DTYPE_TO_ST, MAX_TENSORS, ST_TO_DTYPE

FORMAT = "unbroken-chunkmap"
SUFFIX = ".chunks.json"
_TENSORS = ".safetensors"
MAX_DIMS = 64


def map_name(tensor_file: str) -> str:
    """The chunk map that stands for ``tensor_file`` (``t00-model.safetensors`` ->
    ``t00-model.chunks.json``)."""
    return tensor_file.removesuffix(_TENSORS) + SUFFIX


def tensor_file_of(map_file: str) -> str:
    """The inverse of :func:`map_name`."""
    return map_file.removesuffix(SUFFIX) + _TENSORS


def encode(entries: dict[str, tuple[torch.dtype, tuple[int, ...], str]]) -> bytes:
    """A chunk map of ``{key: (dtype, shape, chunk id)}``."""
    doc = {"format": FORMAT, "tensors": {k: {"dtype": DTYPE_TO_ST[d], "shape": list(s), "chunk": c}
                                         for k, (d, s, c) in entries.items()}}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode(raw: bytes, fname: str, files: dict[str, FileEntry]) -> dict[str, tuple[torch.dtype, tuple[int, ...], str]]:
    """Parse and check a chunk map against the manifest's ``files`` (its chunk entries):
    ``{key: (dtype, shape, chunk id)}``; any defect raises :class:`CorruptCheckpointError`."""
    try:
        doc = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=strict_object)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), dict):
            raise ValueError("not a chunk map")
        tensors = doc["tensors"]
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"{len(tensors)} tensors, over the limit of {MAX_TENSORS}")
        out: dict[str, tuple[torch.dtype, tuple[int, ...], str]] = {}
        for key, e in tensors.items():
            if not isinstance(e, dict) or set(e) != {"dtype", "shape", "chunk"}:
                raise ValueError(f"malformed entry for {key!r}")
            dtype = ST_TO_DTYPE.get(e["dtype"]) if isinstance(e["dtype"], str) else None
            shape = e["shape"]
            if dtype is None:
                raise ValueError(f"unknown dtype {str(e['dtype'])[:40]!r} for {key!r}")
            if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
                    not all(type(d) is int and 0 <= d < 1 << 62 for d in shape) or \
                    math.prod(d for d in shape if d) * dtype.itemsize >= 1 << 62:  # strides fit, empty or not
                raise ValueError(f"bad shape for {key!r}")
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a tensor key that is not UTF-8") from None
            cid = check_chunk_id(e["chunk"])
            entry = files.get(CHUNK_PREFIX + cid)
            if entry is None:
                raise ValueError(f"{key!r} uses chunk {cid[:16]}…, which the manifest does not list")
            if math.prod(shape) * dtype.itemsize != entry.size:
                raise ValueError(f"{key!r}: {shape} of {e['dtype']} does not fit chunk {cid[:16]}… "
                                 f"({entry.size} bytes)")
            out[key] = (dtype, tuple(shape), cid)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{fname}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{fname} is malformed ({str(e)[:200]})") from None
    return out


def tensor_of(buf: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor held by a verified chunk's bytes (a view, no copy)."""
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
