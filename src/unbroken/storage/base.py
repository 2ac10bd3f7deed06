"""The storage protocol: where checkpoint bytes go, and how a checkpoint commits.

A storage holds the checkpoints of one run, each a named folder of flat files.
The writer's call order is fixed::

    staging = storage.stage(name)          # a private place no reader looks at
    with staging.open(file) as f: ...      # once per data file, then manifest.json last
    staging.commit()                       # the checkpoint becomes visible, atomically
    # or staging.abort() on any error: nothing becomes visible

Readers call ``list_committed()``, then ``read(name, file, size)`` per file. A
backend's commit must make a checkpoint appear whole or not at all: the local
filesystem stages in a hidden sibling folder and renames it (see
:mod:`unbroken.storage.local`); an object store treats the manifest uploaded last as
the commit marker. Retention calls ``delete`` only for checkpoints older than one
that has already committed.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Protocol

Buffer = Any
"""A writable object supporting the buffer protocol (bytearray, uint8 numpy array)."""


class Staging(Protocol):
    """A checkpoint being written."""

    name: str

    def open(self, file: str) -> BinaryIO:
        """A new file for writing; closing it makes its bytes durable."""
        ...

    def commit(self) -> str:
        """Publish the checkpoint under its final name (returned); atomic."""
        ...

    def abort(self) -> None:
        """Discard everything written; never raises."""
        ...


class Storage(Protocol):
    """Checkpoints of one run. See the module docstring for the call order."""

    def stage(self, name: str) -> Staging: ...

    def list_committed(self) -> list[str]:
        """Names of checkpoints whose commit completed (not yet verified)."""
        ...

    def read(self, name: str, file: str, size: int | None = None) -> Buffer:
        """The whole content of one file, in a writable buffer (``bytearray``, a uint8
        numpy array, ...); ``size`` is the expected size, if known."""
        ...

    def delete(self, name: str) -> None: ...

    def quarantine(self, name: str, reason: str) -> str | None:
        """Move a bad checkpoint out of the way, keeping it for inspection."""
        ...

    def clean_stale(self) -> list[str]:
        """Remove leftovers of writers that died mid-save; return what was removed."""
        ...

    def describe(self, name: str) -> str:
        """A human-readable location of a checkpoint (path or URL)."""
        ...
