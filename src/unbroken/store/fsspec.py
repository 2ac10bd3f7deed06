"""A run on an object store or any other fsspec filesystem, committed by its manifest.

Object stores have no rename, but a single PUT is atomic: an object is either absent
or whole. So a checkpoint's data objects are uploaded first (in parallel, large files
as multipart uploads), and ``manifest.json`` is PUT last: it is the commit marker.
Readers list ``<run>/*/manifest.json`` and never look at a folder without one; the next
writer (holding the run's lease) removes such leftovers, and aborts multipart uploads a
dead writer left open. Deletion removes the manifest first, so a half-deleted checkpoint
is never visible.

Every remote call is retried with backoff for transient errors (:mod:`.retry`); each
file part is retried on its own, so a server that restarts in the middle of an upload
costs a few seconds, not the checkpoint. Downloads fetch large files as parallel ranged
GETs straight into the reader's buffer; the caller verifies the checksum.

Credentials stay in ``storage_options`` (or the backend's own environment variables):
the store's ``url`` and every message carry the location only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CorruptCheckpointError, StorageError
from .base import CHUNKS, COMMIT_FILE, MAX_META_BYTES, QUARANTINE, Buffer, check_meta_name, check_name
from .local import MAX_MANIFEST_BYTES
from .readfile import Hasher, allocate
from .retry import Retry
from .upload import FsspecStaging, wait_all

log = logging.getLogger("unbroken")
PART_SIZE = 64 * 1024 * 1024
"""Multipart part size and ranged-read size (S3 allows 5 MiB to 5 GiB per part)."""


def cache_root() -> Path:
    """Where data derived from remote runs (their index) is kept: ``$UNBROKEN_CACHE_DIR`` or
    ``~/.cache/unbroken``."""
    return Path(os.environ.get("UNBROKEN_CACHE_DIR") or Path.home() / ".cache" / "unbroken")


class FsspecStore:
    """A run at ``root`` (a path in ``fs``, e.g. ``bucket/prefix``) of an fsspec filesystem."""

    remote = True

    def __init__(self, fs: Any, root: str, url: str, *, retry: Retry | None = None,
                 part_size: int = PART_SIZE, workers: int = 8, readonly: bool = False,
                 chunk_root: str | None = None) -> None:
        self.fs, self.root, self.url = fs, root.rstrip("/"), url.rstrip("/")
        protocol = type(fs).protocol  # s3a:// and s3:// are one run: (its lease, its index cache)
        self.identity = f"{protocol if isinstance(protocol, str) else protocol[0]}://{self.root}"
        self.chunk_root = chunk_root or self.path(CHUNKS)
        self.retry = retry or Retry()
        self.part_size, self.workers, self.readonly = part_size, workers, readonly
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # ----------------------------------------------------------------- helpers
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="unbroken-io")
            return self._pool

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with retries; errors become messages about this run."""
        return self.retry.call(f"{what} ({self.url})", lambda: fn(*args, **kwargs))

    def objects(self) -> dict[str, set[str]]:
        """``{checkpoint name: {file, ...}}`` from one listing of the run (quarantine excluded)."""
        self.fs.invalidate_cache(self.root)
        try:
            keys = self.call("list", self.fs.find, self.root, detail=False)
        except FileNotFoundError:
            return {}
        out: dict[str, set[str]] = {}
        prefix = self.root + "/"
        for key in keys:
            key = key.lstrip("/") if not prefix.startswith("/") else key
            if not key.startswith(prefix):
                continue
            parts = key[len(prefix):].split("/")
            if parts[0] in (QUARANTINE, CHUNKS):
                continue
            if len(parts) == 2 and not parts[0].startswith("."):
                out.setdefault(parts[0], set()).add(parts[1])
            elif len(parts) > 2:
                out.setdefault(parts[0], set())  # nested junk: an uncommitted leftover at best
        return out

    # ------------------------------------------------------------------- setup
    def check(self, deadline_s: float = 15.0) -> None:
        try:
            quick = Retry(deadline_s=min(self.retry.deadline_s, deadline_s))
            quick.call(f"check ({self.url})", lambda: self.fs.ls(self.root.split("/")[0], detail=False))
        except FileNotFoundError:
            raise StorageError(f"{self.url}: the bucket or container {self.root.split('/')[0]!r} does not "
                               "exist; create it first (unbroken never creates buckets)") from None
        except PermissionError as e:
            raise StorageError(f"{self.url}: access denied ({e}); check the credentials (storage_options "
                               "key/secret, a profile, or the AWS_* / backend environment variables)") from None
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - any backend error: one clear StorageError
            raise StorageError(f"{self.url}: cannot reach the store: {type(e).__name__}: {e}") from None

    def lock(self) -> Any:
        from .lease import LeaseLock

        return LeaseLock(self)

    def local_dir(self) -> Path:
        path = cache_root() / "runs" / hashlib.sha256(self.identity.encode()).hexdigest()[:16]
        path.mkdir(parents=True, exist_ok=True)
        (path / "location.txt").write_text(self.url + "\n")
        return path

    def describe(self, name: str) -> str:
        return f"{self.url}/{name}"

    def free_bytes(self) -> int | None:
        return None

    # ------------------------------------------------------------------- write
    def stage(self, name: str) -> FsspecStaging:
        return FsspecStaging(self, self.free_name(check_name(name, "checkpoint")))

    def join(self, token: str) -> FsspecStaging:
        return FsspecStaging(self, check_name(token, "checkpoint"), joined=True)

    def free_name(self, name: str) -> str:
        taken = set(self.objects())
        qdir = self.quarantined()
        taken |= set(qdir.objects()) if qdir is not None else set()
        candidate, n = name, 1
        while candidate in taken:
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    def open_writer(self, path: str, staging: FsspecStaging) -> BinaryIO:
        """A writer for one data object; backends specialise this (S3: parallel multipart)."""
        return self.fs.open(path, "wb")

    def put(self, path: str, data: bytes | bytearray) -> None:
        self.call("upload", self.fs.pipe_file, path, data)

    def remove(self, paths: list[str]) -> None:
        if paths:
            self.call("delete", self.fs.rm, paths)

    def delete(self, name: str) -> None:
        check_name(name, "checkpoint")
        files = self.objects().get(name, set())
        if COMMIT_FILE in files:
            self.remove([self.path(name, COMMIT_FILE)])  # un-commit first
        self.remove([self.path(name, f) for f in sorted(files - {COMMIT_FILE})])

    def quarantine(self, name: str, reason: str) -> str | None:
        files = self.objects().get(name)
        if not files:
            return None
        qdir = FsspecStore(self.fs, self.path(QUARANTINE), self.url + "/" + QUARANTINE, retry=self.retry)
        target = name
        existing = set(qdir.objects())
        n = 1
        while target in existing:
            n += 1
            target = f"{name}.{n}"
        try:
            for f in sorted(files - {COMMIT_FILE}) + ([COMMIT_FILE] if COMMIT_FILE in files else []):
                self.call("copy", self.fs.copy, self.path(name, f), qdir.path(target, f))
            qdir.put(qdir.path(f"{target}.reason.txt"), (reason + "\n").encode())
            self.delete(name)
        except Exception as e:  # noqa: BLE001 - best effort: left in place and reported as such
            log.warning("could not quarantine %s: %s", self.describe(name), e)
            return None
        return qdir.describe(target)

    def clean_stale(self) -> list[str]:
        """Remove every uncommitted checkpoint: call only while holding the run's lease."""
        removed = []
        for name, files in self.objects().items():
            if COMMIT_FILE not in files:
                self.remove([self.path(name, f) for f in sorted(files)])
                removed.append(name)
        return removed

    def write_meta(self, file: str, data: bytes) -> None:
        self.put(self.path(check_meta_name(file)), data)

    # -------------------------------------------------------------------- read
    def list_committed(self) -> list[str]:
        return sorted(n for n, files in self.objects().items() if COMMIT_FILE in files and _plain(n))

    def list_uncommitted(self) -> list[str]:
        return sorted(n for n, files in self.objects().items() if COMMIT_FILE not in files)

    def quarantined(self) -> FsspecStore | None:
        q = FsspecStore(self.fs, self.path(QUARANTINE), self.url + "/" + QUARANTINE, retry=self.retry,
                        readonly=True, chunk_root=self.chunk_root)  # their chunks stay in the run
        return q if q.objects() else None

    def size_of(self, path: str) -> int | None:
        try:
            info = self.call("stat", self.fs.info, path)
        except FileNotFoundError:
            return None
        if info.get("type") not in (None, "file"):
            return None
        return int(info["size"])

    def read(self, name: str, file: str, size: int | None = None, hasher: Hasher | None = None) -> Buffer:
        if file != COMMIT_FILE:
            check_name(file)
        return self._read_object(self.path(check_name(name, "checkpoint"), file), file, size, hasher)

    def _read_object(self, path: str, file: str, size: int | None, hasher: Hasher | None) -> Buffer:
        actual = self.size_of(path)
        if actual is None:
            raise CorruptCheckpointError(f"{file} is missing")
        if size is None and actual > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{file} is implausibly large ({actual} bytes)")
        if size is not None and actual != size:
            raise CorruptCheckpointError(f"{file} has {actual} bytes, the manifest says {size}")
        buf = self.read_into(path, allocate(actual, file), file)
        if hasher is not None:  # parallel ranges arrive out of order: hashed once all are in
            hasher.update(buf)
        return buf

    def read_into(self, path: str, buf: Buffer, file: str) -> Buffer:
        """Fill ``buf`` with the object at ``path``: parallel ranged reads for large objects."""
        n = len(buf)
        spans = [(i, min(i + self.part_size, n)) for i in range(0, n, self.part_size)] or [(0, 0)]

        def fetch(span: tuple[int, int]) -> None:
            start, end = span
            data = self.call("download", self.fs.cat_file, path, start=start, end=end) if end > start else b""
            if len(data) != end - start:
                raise CorruptCheckpointError(f"{file} changed size while being read")
            buf[start:end] = memoryview(data)

        if len(spans) == 1:
            fetch(spans[0])
        else:
            futures = [self.pool().submit(fetch, s) for s in spans]
            wait_all(futures)
        return buf

    # ------------------------------------------------------------------ chunks
    def put_chunk(self, cid: str, data: Buffer) -> None:
        self.put(f"{self.chunk_root}/{cid}", bytes(data))  # one PUT: whole or absent

    def sync_chunks(self) -> None:
        pass  # every PUT returned: durable

    def read_chunk(self, cid: str, size: int, hasher: Hasher | None = None) -> Buffer:
        try:
            return self._read_object(f"{self.chunk_root}/{cid}", f"chunk {cid}", size, hasher)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e} ({self.url}/{CHUNKS})") from None

    def list_chunks(self) -> dict[str, float]:
        self.fs.invalidate_cache(self.chunk_root)
        try:
            found = self.call("list", self.fs.find, self.chunk_root, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, float] = {}
        for key, info in found.items():
            cid = key.rstrip("/").rsplit("/", 1)[-1]
            if len(cid) == 64 and all(c in "0123456789abcdef" for c in cid):
                out[cid] = _mtime(info)
        return out

    def delete_chunk(self, cid: str) -> None:
        try:
            self.remove([f"{self.chunk_root}/{cid}"])
        except FileNotFoundError:
            pass

    def clean_chunk_temps(self) -> list[str]:
        return []  # a PUT is whole or absent: nothing half-written to clean

    def quarantine_chunk(self, cid: str, reason: str) -> str | None:
        target = self.path(QUARANTINE, CHUNKS, cid)
        try:
            self.call("copy", self.fs.copy, f"{self.chunk_root}/{cid}", target)
            self.put(target + ".reason.txt", (reason + "\n").encode())
            self.delete_chunk(cid)
        except Exception as e:  # noqa: BLE001 - best effort: left in place and reported as such
            log.warning("could not quarantine chunk %s: %s", cid, e)
            return None
        return f"{self.url}/{QUARANTINE}/{CHUNKS}/{cid}"

    def read_meta(self, file: str) -> bytes | None:
        path = self.path(check_meta_name(file))
        size = self.size_of(path)
        if size is None:
            return None
        if size > MAX_META_BYTES:
            raise CorruptCheckpointError(f"{self.url}/{file} is implausibly large ({size} bytes)")
        return bytes(self.read_into(path, bytearray(size), file))


def _mtime(info: dict[str, Any]) -> float:
    """An object's modification time from an fsspec listing (S3: ``LastModified``)."""
    for key in ("LastModified", "mtime", "last_modified", "created"):
        v = info.get(key)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return 0.0  # unknown: treated as old (collected once unreferenced)


def _plain(name: str) -> bool:
    try:
        check_name(name)
        return True
    except CorruptCheckpointError:
        return False
