"""Turn a path or URL into a store: the one place that knows every backend.

- a path (``runs/exp1``, ``/scratch/exp1``), a ``file://`` or ``local://`` URL (``file:///scratch/exp1``,
  ``file://localhost/scratch/exp1``): :class:`.local.LocalStore`, at the absolute path (taken once,
  so a later ``chdir`` changes nothing). Every spelling of a folder (relative or absolute, a
  trailing slash, ``..``, a symlinked parent, any URL) opens the same run: one
  ``identity`` (the real path), one lock, one index. A ``file://`` URL naming another host
  or a relative path is refused, never read as some other folder;
- ``s3://bucket/prefix``: :class:`.s3.S3Store` (needs ``pip install -e '.[s3]'``);
- any other URL fsspec knows (``gs://``, ``az://``, ``abfs://``, ``memory://``, ...):
  :class:`.fsspec.FsspecStore`, with the backend package fsspec names.

``storage_options`` go to the fsspec filesystem unchanged (``endpoint_url``, ``key``,
``secret``, ``profile``, ``anon``, ``client_kwargs``...); they are never written to a
manifest, the index or a log. An unknown scheme is an error, never a local folder
named ``s3:``; so is an empty location (``""``, blanks, ``None``), never the current folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import StorageError
from .fsspec import FsspecStore
from .local import LocalStore
from .ram import RamStore
from .retry import Retry

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
          "abfss": "azure", "adl": "azure"}
"""URL scheme -> the ``unbroken[...]`` extra that installs its backend."""


def is_url(location: str | os.PathLike[str]) -> bool:
    return isinstance(location, str) and "://" in location


def redact(url: str) -> str:
    """A URL without any ``user:password@`` part (for messages, manifests, the index)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def location_text(location: Any) -> str:
    """``location`` as text; :class:`StorageError` if it names nothing (``""``, blanks, ``None``:
    never the current folder by accident) or is not a path or URL."""
    if location is None:
        raise StorageError(_NO_LOCATION.format("None"))
    try:
        text = os.fspath(location)
    except TypeError:
        raise StorageError(f"a run location is a folder or a URL, not {type(location).__name__} "
                           f"({location!r})") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise StorageError(_NO_LOCATION.format(repr(text)))
    return text


_NO_LOCATION = ("no run location was given ({}): pass a folder (runs/exp1) or a URL (s3://bucket/exp1); "
                "for the current folder, say so with '.'")
_LOCAL_URL = re.compile(r"^(file|local):", re.IGNORECASE)


def local_path(url: str) -> str:
    """The absolute path a ``file://`` or ``local://`` URL names (RFC 8089: no host, or
    ``localhost``); :class:`StorageError` for another host or a relative path."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc.lower() not in ("", "localhost") or not path.startswith("/") or parts.query or parts.fragment:
        if not path.strip("/") and not parts.netloc:
            raise StorageError(_NO_LOCATION.format(repr(url)))
        raise StorageError(f"{redact(url)} does not name a folder on this machine: write file:///absolute/path "
                           "(three slashes; file://localhost/absolute/path also works), or pass the path "
                           "itself (runs/exp1); percent-encode a ? or # in a folder name (%3F, %23)")
    return os.path.abspath(path)


def open_ram_store(folder: str | os.PathLike[str], keep_last: int) -> RamStore:
    """The RAM tier's store in ``folder`` (a tmpfs), holding ``keep_last`` checkpoints plus one."""
    return RamStore(os.path.abspath(folder), keep_last)


def open_store(location: str | os.PathLike[str] | Any, storage_options: Mapping[str, Any] | None = None,
               *, readonly: bool = False, retry: Retry | None = None) -> Any:
    """The store of the run at ``location`` (a path, a URL, or a store, returned as is); ``retry``
    bounds a remote store's retries of one request (default :class:`~.retry.Retry`)."""
    if hasattr(location, "list_committed") and hasattr(location, "stage"):
        return location
    text = location_text(location)
    if _LOCAL_URL.match(text):
        if storage_options:
            raise StorageError(f"storage_options were given, but {redact(text)} is a local folder")
        return LocalStore(local_path(text), readonly=readonly)
    if not is_url(text):
        if storage_options:
            raise StorageError(f"storage_options were given, but {text!r} is a local path")
        return LocalStore(os.path.abspath(text), readonly=readonly)
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    url = f"{scheme}://{rest.rstrip('/')}"
    try:
        import fsspec
        from fsspec.registry import known_implementations, registry

        if scheme not in known_implementations and scheme not in registry:
            raise StorageError(f"unknown storage scheme {scheme!r} in {redact(url)}: use a local path, file://, "
                               "s3://, gs://, az://, memory:// or another fsspec protocol")
        cls = fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        extra = EXTRAS.get(scheme)
        hint = f"pip install -e '.[{extra}]' in unbroken's folder" if extra else f"install the fsspec backend for {scheme}://"
        raise StorageError(f"{redact(url)} needs a package that is not installed ({e}); {hint}") from None
    options = dict(storage_options or {})
    if scheme != "memory":
        options.setdefault("use_listings_cache", False)  # several writers and readers: never a stale listing
    if scheme in ("s3", "s3a"):
        # every request is retried by unbroken (.retry: backoff, jitter, the tier's request_deadline_s);
        # botocore's own retries inside each attempt (5 with backoff by default: 6-7 s per attempt against
        # a refused connection) would stretch that deadline several times over: one quick retry is left
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 2})
        options["config_kwargs"] = config
    try:
        fs = cls(**options)
    except TypeError as e:
        raise StorageError(f"invalid storage_options for {scheme}://: {e}") from None
    from fsspec.implementations.local import LocalFileSystem

    if issubclass(cls, LocalFileSystem):  # another name of a local folder: its one lock is the flock
        return LocalStore(os.path.abspath(cls._strip_protocol(url)), readonly=readonly)
    root = cls._strip_protocol(url)
    if isinstance(root, list):
        root = root[0]
    root = root.rstrip("/")
    if not root.strip("/"):
        raise StorageError(f"{scheme}:// names no bucket or folder; use {scheme}://bucket/run-name")
    clean = redact(url)
    if scheme in ("s3", "s3a"):
        from .s3 import S3Store

        return S3Store(fs, root, clean, readonly=readonly, retry=retry)
    return FsspecStore(fs, root, clean, readonly=readonly, retry=retry)


def split_checkpoint(location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
                     ) -> tuple[Any, str]:
    """``(store of the run, checkpoint name)`` for the location of one checkpoint folder."""
    text = location_text(location)
    if _LOCAL_URL.match(text):
        text = local_path(text)
    if is_url(text):
        url = text.rstrip("/")
        parent, _, name = url.rpartition("/")
        if "://" not in parent or not parent.split("://", 1)[1]:
            raise StorageError(f"{redact(url)} is not the location of a checkpoint inside a run")
        return open_store(parent, storage_options), name
    path = os.path.abspath(text)
    if os.path.islink(path):  # a link the user names is used as given: the store is its target's parent
        path = os.path.realpath(path)
    return open_store(os.path.dirname(path), storage_options), os.path.basename(path)
