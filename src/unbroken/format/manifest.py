"""``manifest.json``: the single source of truth about a checkpoint, written last.

A checkpoint folder is valid only if its manifest parses, names a format version this
code can read, and every file it lists exists with the recorded size and xxh3-128
checksum. File names are single, plain path components (no ``/``, no ``..``, no
absolute paths), so a manifest can never make a reader touch a file outside the
checkpoint folder.

Format version 3 (incremental checkpoints, :mod:`unbroken.checkpoint.chunks`) adds ``chunks``: the
content-addressed tensor chunks the checkpoint uses, by SHA-256 id, each with its size and
xxh3-128 checksum like a file; they live in the run's ``chunks/`` folder, not in the
checkpoint folder. In memory they sit in :attr:`Manifest.files` under ``@<id>``, so every
piece of code that verifies, copies or gathers "the files of a checkpoint" handles them.
A checkpoint without chunks is still written as format version 2.

Since format version 2 the manifest protects itself: it ends with exactly
``,\n "manifest_xxh3_128": "<32 hex digits>"\n}\n`` and the digest is the xxh3-128 of
every byte before that trailer. It is checked before any field is trusted, so a flipped
digit in ``seq`` or ``step`` is corruption, not a rollback.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError, NewerFormatError

FORMAT_NAME = "unbroken"
FORMAT_VERSION = 3
"""The newest format this code reads; it writes 3 only for checkpoints with chunks."""
CHUNK_PREFIX = "@"
"""``Manifest.files`` key prefix of a chunk (``@<64 hex digits>``); never a file name."""
MANIFEST = "manifest.json"
STATE_FILE = "state.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_HEX128 = re.compile(r"^[0-9a-f]{32}$")
_CHUNK_ID = re.compile(r"^[0-9a-f]{64}$")
TRAILER_KEY = b',\n "manifest_xxh3_128": "'
TRAILER_END = b'"\n}\n'
TRAILER_LEN = len(TRAILER_KEY) + 32 + len(TRAILER_END)
_INT64 = 2**63
_MAX_INT_DIGITS = 300  # float() of any such integer is finite
_MAX_TIME = 253402300799  # 9999-12-31: the last time stamp datetime can show


def new_hasher() -> xxhash.xxh3_128:
    """The checksum used for every file: xxh3-128 (fast, non-cryptographic)."""
    return xxhash.xxh3_128()


def check_file_name(name: Any) -> str:
    """Return ``name`` if it is a safe file name inside a checkpoint, else raise."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or name in (".", "..") or name == MANIFEST:
        raise CorruptCheckpointError(f"manifest lists an unsafe or invalid file name {name!r}")
    return name


def check_chunk_id(cid: Any) -> str:
    """Return ``cid`` if it is a chunk id (64 lowercase hex digits: a SHA-256), else raise."""
    if not isinstance(cid, str) or not _CHUNK_ID.fullmatch(cid):
        raise CorruptCheckpointError(f"invalid chunk id {str(cid)[:80]!r}")
    return cid


def is_chunk(key: str) -> bool:
    """True for a :attr:`Manifest.files` key that names a chunk (``@<id>``), not a file."""
    return key.startswith(CHUNK_PREFIX)


@dataclass(frozen=True)
class FileEntry:
    """Size and checksum of one file of a checkpoint."""

    size: int
    xxh3_128: str


@dataclass
class Manifest:
    """Everything recorded about one checkpoint. ``seq`` orders commits within a run."""

    step: int
    seq: int
    files: dict[str, FileEntry]
    created: float = field(default_factory=time.time)
    metrics: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, int] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    kind: str = "regular"
    probe: dict[str, float] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    world_size: int = 1
    format_version: int = 2

    def __post_init__(self) -> None:
        if self.format_version < 3 and any(is_chunk(k) for k in self.files):
            self.format_version = 3  # chunks need a reader that knows them

    @property
    def total_bytes(self) -> int:
        """Every byte the checkpoint needs, its chunks included (shared ones too)."""
        return sum(f.size for f in self.files.values())

    @property
    def chunks(self) -> dict[str, FileEntry]:
        """The chunks this checkpoint uses, by id."""
        return {k[1:]: v for k, v in self.files.items() if is_chunk(k)}

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "seq": self.seq,
            "kind": self.kind,
            "tags": list(self.tags),
            "probe": {k: (v if math.isfinite(v) else repr(v)) for k, v in self.probe.items()},
            "created": self.created,
            "metrics": self.metrics,
            "progress": self.progress,
            "world_size": self.world_size,
            "files": {k: {"size": v.size, "xxh3_128": v.xxh3_128} for k, v in sorted(self.files.items())
                      if not is_chunk(k)},
            "environment": self.environment,
        }
        if self.format_version >= 3:
            doc["chunks"] = {k[1:]: {"size": v.size, "xxh3_128": v.xxh3_128}
                             for k, v in sorted(self.files.items()) if is_chunk(k)}
        body = json.dumps(doc, indent=1, allow_nan=False).encode("utf-8")
        assert body.endswith(b"\n}")
        prefix = body[:-2]
        h = new_hasher()
        h.update(prefix)
        return prefix + TRAILER_KEY + h.hexdigest().encode() + TRAILER_END

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and validate a manifest; any problem raises :class:`CorruptCheckpointError`."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError("manifest.json is implausibly large")
        protected = _check_trailer(raw)
        try:
            doc = json.loads(raw.decode("utf-8"), object_pairs_hook=strict_object, parse_constant=_no_constant,
                             parse_int=_bounded_int, parse_float=_finite_float)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurd nesting
            raise CorruptCheckpointError(f"manifest.json does not parse ({str(e)[:200]})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError("manifest.json is not an unbroken manifest")
        version = doc.get("format_version")
        if type(version) is not int or version < 1:
            raise CorruptCheckpointError(f"manifest.json has an invalid format_version {version!r}")
        if version >= 2 and not protected:
            raise CorruptCheckpointError("manifest.json has no valid self-checksum trailer (damaged)")
        if version > FORMAT_VERSION:
            raise NewerFormatError(
                f"checkpoint format version {version} is newer than this unbroken reads "
                f"({FORMAT_VERSION}); upgrade unbroken to load it"
            )
        try:
            files = _entries(doc["files"], "files", check_file_name, lambda n: repr(n), "")
            if version >= 3:
                files.update(_entries(doc.get("chunks", {}), "chunks", check_chunk_id, lambda c: f"chunk {c[:16]}",
                                      CHUNK_PREFIX))
            if sum(f.size for f in files.values()) >= _INT64:
                raise TypeError("the files add up to more than 2**63 bytes")
            step, seq = doc["step"], doc["seq"]
            if not _count(step) or not _count(seq):
                raise TypeError("step and seq must be integers in [0, 2**63)")
            created = doc["created"]
            if type(created) not in (int, float) or not 0 <= created <= _MAX_TIME:
                raise TypeError(f"created must be a time stamp, got {_show(created)}")
            created = float(created)
            metrics, progress, env = doc.get("metrics", {}), doc.get("progress", {}), doc.get("environment", {})
            if not all(isinstance(x, dict) for x in (metrics, progress, env)):
                raise TypeError("metrics, progress and environment must be objects")
            if not all(_count(v) for v in progress.values()):
                raise TypeError("progress counters must be integers in [0, 2**63)")
            probe_doc = doc.get("probe", {})
            if not isinstance(probe_doc, dict):
                raise TypeError("probe must be an object")
            probe = {}
            for k, v in probe_doc.items():
                if type(v) not in (int, float) and v not in ("nan", "inf", "-inf"):
                    raise TypeError(f"probe value {_show(v)} for {k!r} is not a number")
                probe[k] = float(v)
            tags = doc.get("tags", [])
            if not isinstance(tags, list) or not all(isinstance(t, str) and _utf8(t) for t in tags):
                raise TypeError("tags must be a list of strings")
            kind = doc.get("kind", "regular")
            if not isinstance(kind, str) or not _utf8(kind) or len(kind) > 1000:
                raise TypeError("kind must be a string")
            world_size = doc.get("world_size", 1)
            if type(world_size) is not int or not 1 <= world_size <= 1 << 20:
                raise TypeError("world_size must be a positive integer")
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CorruptCheckpointError(f"manifest.json is malformed ({type(e).__name__}: {e})") from None
        if STATE_FILE not in files:
            raise CorruptCheckpointError(f"manifest.json does not list {STATE_FILE}")
        both = [f for f in files
                if f.endswith(".chunks.json") and f.removesuffix(".chunks.json") + ".safetensors" in files]
        if both:
            raise CorruptCheckpointError(f"manifest.json lists {both[0]} and the tensor file it stands for: "
                                         "which one holds the tensors is ambiguous")
        return cls(step=step, seq=seq, files=files, created=created, metrics=metrics,
                   progress=progress, environment=env, kind=kind, probe=probe, tags=tags,
                   world_size=world_size, format_version=version)


def _entries(section: Any, what: str, check: Any, label: Any, prefix: str) -> dict[str, FileEntry]:
    """The ``{name: {size, xxh3_128}}`` object ``section`` of a manifest (``files`` or ``chunks``),
    every name passed through ``check``, keyed by ``prefix + name``."""
    if not isinstance(section, dict):
        raise TypeError(f"{what} is not an object")
    out = {}
    for name, entry in section.items():
        check(name)
        if not isinstance(entry, dict):
            raise TypeError(f"the entry of {label(name)} is not an object")
        size, digest = entry["size"], entry["xxh3_128"]
        if not _count(size) or not isinstance(digest, str) or not _HEX128.fullmatch(digest):
            raise TypeError(f"bad size or checksum for {label(name)}")
        out[prefix + name] = FileEntry(size, digest)
    return out


def _check_trailer(raw: bytes) -> bool:
    """True if ``raw`` ends with a self-checksum trailer that matches; a trailer that does not
    match is corruption. False if there is no trailer (format version 1)."""
    tail = raw[-TRAILER_LEN:]
    if len(raw) < TRAILER_LEN or not (tail.startswith(TRAILER_KEY) and tail.endswith(TRAILER_END)):
        if b'"manifest_xxh3_128"' in raw:
            raise CorruptCheckpointError("manifest.json: its self-checksum trailer is damaged")
        return False
    h = new_hasher()
    h.update(raw[:-TRAILER_LEN])
    if h.hexdigest().encode() != tail[len(TRAILER_KEY):len(TRAILER_KEY) + 32]:
        raise CorruptCheckpointError("manifest.json: checksum mismatch (the manifest itself was altered "
                                     "or damaged)")
    return True


def _count(x: Any) -> bool:
    """True for an integer that fits the signed 64-bit columns of the index: step, seq, a size."""
    return type(x) is int and 0 <= x < _INT64


def _utf8(s: str) -> bool:
    """False for a string holding a lone surrogate (valid JSON, but no UTF-8: SQLite refuses it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _show(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _no_constant(s: str) -> Any:
    raise ValueError(f"{s} is not JSON")  # NaN, Infinity: the writer never emits them


def _bounded_int(s: str) -> int:
    # Every integer the writer emits fits 64 bits; a user's metric may be bigger, but one of
    # hundreds of digits would make float() of it overflow wherever it is read.
    if len(s) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(s)} digits")
    return int(s)


def _finite_float(s: str) -> float:
    x = float(s)
    if not math.isfinite(x):  # 1e999 parses as inf: never written (allow_nan=False)
        raise ValueError(f"the number {s[:40]} overflows")
    return x


def strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook that rejects duplicate keys (a classic parser-confusion trick)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out
