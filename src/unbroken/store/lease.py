"""One writer per remote run: a lease object where ``flock`` cannot reach.

The lease is ``<run>/.lock.json``: ``{"owner", "host", "pid", "acquired", "expires"}``.
A writer creates it with a conditional PUT (``If-None-Match: *``), renews it every
``ttl/3`` seconds with ``If-Match: <etag of its last write>`` from a background thread,
and deletes it when it closes. A second writer that finds a live lease is refused with
:class:`~unbroken.errors.RunLockedError` naming the holder.

Taking over a dead writer's lease:

- same host, holder pid gone (a killed process, ``torchrun`` or a requeue on the same
  node): at once;
- otherwise the lease must expire: the new writer waits up to one ``ttl`` (logging why).
  If the lease was renewed meanwhile the holder is alive and the new writer is refused.
  The takeover is again a conditional PUT on the ETag it saw, so of two writers racing
  for a dead lease exactly one wins.

Nothing leaks, nothing is lost silently:

- A PUT whose answer was lost (the connection dropped after the server wrote it) is
  retried; the retry then finds a lease with this process's owner id and takes it as its
  own, instead of refusing "another process" that is itself. If taking the lease fails
  after it was written, it is deleted again before the error is raised.
- :meth:`LeaseLock.verify`, called before every commit, reads the lease: if it is gone
  (deleted) or names another owner (this process was paused past its expiry and someone
  took it over, which the renewal also notices), the lease is *lost* and ``verify`` raises,
  so a stale writer never commits over the new one. One small GET per commit.
- Within a process every holder of the same run (``s3://`` and ``s3a://`` alike: keyed by
  the store's ``identity``) shares one lease, reference-counted. A holder that is dropped
  without :meth:`~LeaseLock.release` gives its share back when it is garbage-collected, and
  every lease still held when the interpreter exits normally is released then, after the
  ``Checkpointer``'s own close-at-exit (both are :mod:`threading` exit hooks, which run while
  thread pools still work; this one is registered when :mod:`unbroken.store` is imported,
  before that one, and the last registered runs first).

Limits, documented: expiry compares the holder's clock with the reader's (keep clocks
within a few seconds; ``ttl`` is 120 s by default). On stores without conditional
writes (plain fsspec filesystems, S3-compatible servers that ignore the headers) the
lease is write-then-read-back: it stops a second writer that starts while the first one
lives, but two writers starting within the same second could both proceed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any

from .._support.exithooks import at_process_exit
from ..errors import RunLockedError

log = logging.getLogger("unbroken")
LEASE_FILE = ".lock.json"
_held: dict[str, _Lease] = {}  # store identity -> the process's lease on that run
_mutex = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _who(doc: dict[str, Any]) -> str:
    return f"host {doc.get('host')} pid {doc.get('pid')}"


class _Lease:
    """This process's lease on one run: the object in the store and its renewal thread."""

    def __init__(self, store: Any, ttl_s: float) -> None:
        self.store, self.ttl_s = store, ttl_s
        self.path = store.path(LEASE_FILE)
        self.owner = uuid.uuid4().hex
        self.etag: str | None = None
        self.count = 1
        self.lost: str | None = None
        self._written = False  # a PUT of ours may have reached the store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ storage
    def _doc(self) -> bytes:
        now = time.time()
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "acquired": now, "expires": now + self.ttl_s}).encode()

    def _read(self) -> tuple[dict[str, Any], str] | None:
        if hasattr(self.store, "get_with_etag"):
            got = self.store.get_with_etag(self.path)
        else:
            raw = self.store.read_meta(LEASE_FILE)
            got = None if raw is None else (raw, str(hash(raw)))
        if got is None:
            return None
        raw, etag = got
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError
        except ValueError:
            doc = {"owner": "?", "host": "?", "pid": -1, "expires": 0.0}  # garbage: treat as expired
        return doc, etag

    def _put(self, if_match: str | None) -> str | None:
        """Write our lease if the object is absent (None) or unchanged (``if_match``)."""
        data = self._doc()
        self._written = True
        if hasattr(self.store, "put_conditional") and self.store.conditional is not False:
            return self.store.put_conditional(self.path, data, if_match=if_match)
        current = self._read()  # fallback: compare, write, read back
        if (current is None) != (if_match is None) or (current and current[1] != if_match):
            return None
        self.store.write_meta(LEASE_FILE, data)
        time.sleep(0.2)
        back = self._read()
        return back[1] if back and back[0].get("owner") == self.owner else None

    # ------------------------------------------------------------------ taking it
    def take(self) -> None:
        """Create or take over the lease (see the module docstring); if that fails after a PUT
        of ours may have landed, the lease is deleted again before the error is raised."""
        try:
            self._take()
            self._check_conditional()
        except BaseException:
            if self._written:
                self._delete_if_ours()
            raise
        self._thread = threading.Thread(target=self._renew_loop, name="unbroken-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        waited_for: str | None = None
        deadline = time.monotonic() + self.ttl_s + 5
        url = self.store.url
        while True:
            current = self._read()
            if current is None:
                etag = self._put(None)
            else:
                doc, etag_seen = current
                if doc.get("owner") == self.owner:  # our own PUT, whose answer was lost
                    self.etag = etag_seen
                    return
                here = doc.get("host") == socket.gethostname()
                dead = here and not _pid_alive(int(doc.get("pid", -1)))
                expired = float(doc.get("expires", 0)) < time.time()
                if not (dead or expired):
                    if here or waited_for is not None and waited_for != etag_seen or time.monotonic() > deadline:
                        raise RunLockedError(
                            f"{url} is being written by another process ({_who(doc)}, lease renewed "
                            f"until {time.ctime(float(doc.get('expires', 0)))}). Two writers would corrupt "
                            "each other's retention and resume; stop the other run, or use another location.")
                    if waited_for is None:
                        log.warning("%s: the writer lease is held by %s on another host; waiting up to %.0f s "
                                    "for it to expire (a dead writer's lease is taken over then)",
                                    url, _who(doc), self.ttl_s)
                    waited_for = etag_seen
                    time.sleep(min(5.0, max(0.5, float(doc.get("expires", 0)) - time.time() + 0.5)))
                    continue
                log.info("%s: taking over the writer lease of %s (%s)", url, _who(doc),
                         "process gone" if dead else "expired")
                etag = self._put(etag_seen)
            if etag is not None:
                self.etag = etag
                return
            time.sleep(0.2)  # lost a race: look again

    def _check_conditional(self) -> None:
        """Learn once whether the server honours If-None-Match (a second create must fail)."""
        if getattr(self.store, "conditional", False) is None:
            honoured = self.store.put_conditional(self.path, self._doc(), if_match=None) is None
            self.store.conditional = honoured
            if not honoured:
                log.warning("%s ignores conditional writes: the writer lease falls back to "
                            "write-and-read-back (see unbroken.store.lease)", self.store.url)
                back = self._read()
                self.etag = back[1] if back else None

    # ------------------------------------------------------------------ holding it
    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3) and not self.lost:
            try:
                etag = self._put(self.etag)
            except FileNotFoundError:
                etag = None
            except Exception as e:  # noqa: BLE001 - a blip: try again next time, the lease has 2/3 of its ttl left
                log.warning("could not renew the writer lease of %s: %s", self.store.url, e)
                continue
            if etag is None:
                try:
                    current = self._read()
                except Exception:  # noqa: BLE001 - unreadable: the lease is lost either way
                    current = None
                self._lose(current)
                log.error("%s; this process will not commit any more checkpoints", self.lost)
                return
            self.etag = etag

    def _lose(self, current: tuple[dict[str, Any], str] | None) -> None:
        if current is None:
            self.lost = f"the writer lease of {self.store.url} is gone ({LEASE_FILE} was deleted)"
        else:
            self.lost = f"the writer lease of {self.store.url} was taken over by {_who(current[0])}"

    def check(self) -> None:
        """Raise :class:`RunLockedError` unless the lease in the store is still ours."""
        if not self.lost:
            current = self._read()
            if current is None or current[0].get("owner") != self.owner:
                self._lose(current)
        if self.lost:
            raise RunLockedError(f"{self.lost}: another writer may be writing this run now, so this one "
                                 "commits no more checkpoints (nothing was written). Stop the other writer if "
                                 "there is one, then restart this one: it resumes from the newest checkpoint.")

    # ------------------------------------------------------------------ giving it back
    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if not self.lost:
            self._delete_if_ours()

    def _delete_if_ours(self) -> None:
        try:
            if self.etag is not None and hasattr(self.store, "delete_conditional"):
                self.store.delete_conditional(self.path, self.etag)
            else:
                current = self._read()
                if current and current[0].get("owner") == self.owner:
                    self.store.remove([self.path])
        except Exception as e:  # noqa: BLE001 - it expires by itself
            log.warning("could not release the writer lease of %s (it expires in %.0f s): %s",
                        self.store.url, self.ttl_s, e)


def _release(key: str, lease: _Lease) -> None:
    """Give back one share of ``lease``; the last one deletes the lease."""
    with _mutex:
        if _held.get(key) is not lease:
            return
        lease.count -= 1
        if lease.count > 0:
            return
        del _held[key]
    lease.shutdown()


def _release_dropped(key: str, lease: _Lease) -> None:
    """A holder was garbage-collected unreleased: give its share back in a thread of its own,
    never inside the collector (which may run in any thread: one holding ``_mutex``, or the
    store's event loop). The interpreter waits for that thread before it exits."""
    try:
        threading.Thread(target=_release, args=(key, lease), name="unbroken-lease-release").start()
    except RuntimeError:  # the interpreter is shutting down: _release_all_at_exit did it
        pass


def _forget_in_child() -> None:
    """A forked child does not hold its parent's leases: its exit must not delete them."""
    global _mutex
    _held.clear()
    _mutex = threading.Lock()  # another thread may have held it at the fork


@at_process_exit(forget=_forget_in_child)
def _release_all_at_exit() -> None:
    """Leases still held when the interpreter exits (a holder never released, or dropped). A
    :mod:`threading` exit hook (:func:`~unbroken._support.exithooks.at_process_exit`), not ``atexit``: deleting the
    lease is an S3 request, and by ``atexit`` time the thread pools the S3 client resolves
    addresses on are shut down (the delete retried until its deadline: every exit of a process
    that held a lease took 30-60 s)."""
    with _mutex:
        leases = list(_held.values())
        _held.clear()
    for lease in leases:
        lease.shutdown()


class LeaseLock:
    """The writer lease of one remote run; :meth:`acquire` is idempotent, and holders of the
    same run in one process share one lease."""

    def __init__(self, store: Any, ttl_s: float = 120.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.path = store.path(LEASE_FILE)
        self._key = ""
        self._lease: _Lease | None = None
        self._release: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        return self._lease is not None

    @property
    def lost(self) -> str | None:
        """Why the lease was lost (taken over, deleted), or None."""
        return self._lease.lost if self._lease is not None else None

    def acquire(self) -> None:
        """Take the lease, or raise :class:`RunLockedError` naming the holder."""
        if self._lease is not None:
            return
        key = str(getattr(self.store, "identity", None) or self.store.url)
        with _mutex:
            lease = _held.get(key)
            if lease is not None:
                lease.check()  # a lost lease is not shared with a new holder
                lease.count += 1
            else:
                lease = _Lease(self.store, self.ttl_s)
                lease.take()
                _held[key] = lease
            self._lease = lease
            self._key = key
            self._release = weakref.finalize(self, _release_dropped, key, lease)  # if dropped unreleased
            self._release.atexit = False  # exit: _release_all_at_exit, after the Checkpointers closed

    def verify(self) -> None:
        """Raise :class:`RunLockedError` if the lease is no longer ours (see the module docstring)."""
        if self._lease is not None:
            self._lease.check()

    def release(self) -> None:
        if self._release is not None and self._release.detach() is not None and self._lease is not None:
            _release(self._key, self._lease)
        self._lease, self._release = None, None
