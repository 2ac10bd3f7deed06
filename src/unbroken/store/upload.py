"""A checkpoint being uploaded to an fsspec store (:mod:`.fsspec`): its data objects now, in the
background, and its manifest at :meth:`FsspecStaging.commit`, whose PUT is the commit."""

from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any, BinaryIO

from .base import COMMIT_FILE, check_name
from .retry import Retry

if TYPE_CHECKING:
    from .fsspec import FsspecStore

log = logging.getLogger("unbroken")


def wait_all(futures: list[Future]) -> None:
    """Wait for every future; on the first failure cancel the rest and raise it."""
    done, pending = wait(futures, return_when="FIRST_EXCEPTION")
    for f in done:
        if f.exception() is not None:
            for p in pending:
                p.cancel()
            wait(pending)
            raise f.exception()  # type: ignore[misc]


class _ManifestBuffer:
    """The manifest is held until :meth:`FsspecStaging.commit`, where its PUT is the commit."""

    def __init__(self, staging: FsspecStaging) -> None:
        self.staging, self.data = staging, bytearray()

    def write(self, data: Any) -> int:
        self.data += data
        return len(data)

    def close(self) -> None:
        self.staging.manifest = bytes(self.data)

    def __enter__(self) -> _ManifestBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()


class FsspecStaging:
    """A checkpoint being uploaded: data objects now (in the background), the manifest at commit."""

    def __init__(self, store: FsspecStore, name: str, joined: bool = False) -> None:
        self.store, self.name, self.token, self.joined = store, name, name, joined
        self.futures: list[Future] = []
        self.writers: list[Any] = []
        self.manifest: bytes | None = None

    def open(self, file: str) -> BinaryIO:
        if file == COMMIT_FILE:
            return _ManifestBuffer(self)  # type: ignore[return-value]
        writer = self.store.open_writer(self.store.path(self.name, check_name(file)), self)
        self.writers.append(writer)
        return writer

    def flush(self) -> None:
        wait_all(self.futures)
        for w in self.writers:
            finish = getattr(w, "finish", None)
            if finish is not None:
                finish()  # complete multipart uploads

    def commit(self) -> str:
        if self.joined:
            raise RuntimeError("only the coordinator commits")
        self.flush()
        if self.manifest is None:
            raise RuntimeError("commit() before the manifest was written")
        self.store.put(self.store.path(self.name, COMMIT_FILE), self.manifest)
        return self.name

    def abort(self) -> None:
        for f in self.futures:
            f.cancel()
        wait(self.futures)
        for w in self.writers:
            try:
                getattr(w, "abort", lambda: None)()
            except Exception:  # noqa: BLE001 - aborting anyway: the upload is not committed
                pass
        if self.joined:
            return  # the coordinator removes the objects
        try:
            quick = type(self.store)(self.store.fs, self.store.root, self.store.url, retry=Retry(deadline_s=5))
            files = quick.objects().get(self.name, set())
            quick.remove([quick.path(self.name, f) for f in sorted(files)])
        except Exception as e:  # noqa: BLE001 - the server may be down: the next writer removes the leftover
            log.info("could not remove the aborted upload %s yet: %s", self.store.describe(self.name), e)
