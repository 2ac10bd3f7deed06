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

If a renewal finds the lease taken by someone else (this process was paused past its
expiry), the lease is *lost*: :meth:`LeaseLock.verify`, called before every commit,
raises, so a stale writer never commits over the new one.

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
from typing import Any

from ..errors import RunLockedError

log = logging.getLogger("unbroken")
LEASE_FILE = ".lock.json"
_held: dict[str, tuple["LeaseLock", int]] = {}  # url -> (the process's lease, refcount)
_mutex = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


class LeaseLock:
    """The writer lease of one remote run; :meth:`acquire` is idempotent within a process."""

    def __init__(self, store: Any, ttl_s: float = 120.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.path = store.path(LEASE_FILE)
        self._shared: LeaseLock | None = None  # the process-wide holder we piggyback on
        self._etag: str | None = None
        self._owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    @property
    def held(self) -> bool:
        return self._shared is not None

    # ------------------------------------------------------------------ storage
    def _doc(self) -> bytes:
        now = time.time()
        return json.dumps({"owner": self._owner, "host": socket.gethostname(), "pid": os.getpid(),
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
        if hasattr(self.store, "put_conditional") and self.store.conditional is not False:
            return self.store.put_conditional(self.path, data, if_match=if_match)
        current = self._read()  # fallback: compare, write, read back
        if (current is None) != (if_match is None) or (current and current[1] != if_match):
            return None
        self.store.write_meta(LEASE_FILE, data)
        time.sleep(0.2)
        back = self._read()
        return back[1] if back and back[0].get("owner") == self._owner else None

    # ------------------------------------------------------------------ protocol
    def acquire(self) -> None:
        if self.held:
            return
        with _mutex:
            if self.store.url in _held:
                lease, n = _held[self.store.url]
                _held[self.store.url] = (lease, n + 1)
                self._shared = lease
                return
            self._take()
            _held[self.store.url] = (self, 1)
            self._shared = self
            self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="unbroken-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        waited_for: str | None = None
        deadline = time.monotonic() + self.ttl_s + 5
        while True:
            current = self._read()
            if current is None:
                etag = self._put(None)
            else:
                doc, etag_seen = current
                holder = f"host {doc.get('host')} pid {doc.get('pid')}"
                here = doc.get("host") == socket.gethostname()
                dead = here and not _pid_alive(int(doc.get("pid", -1)))
                expired = float(doc.get("expires", 0)) < time.time()
                if not (dead or expired):
                    if here or waited_for is not None and waited_for != etag_seen or time.monotonic() > deadline:
                        raise RunLockedError(
                            f"{self.store.url} is being written by another process ({holder}, lease renewed "
                            f"until {time.ctime(float(doc.get('expires', 0)))}). Two writers would corrupt "
                            "each other's retention and resume; stop the other run, or use another location.")
                    if waited_for is None:
                        log.warning("%s: the writer lease is held by %s on another host; waiting up to %.0f s "
                                    "for it to expire (a dead writer's lease is taken over then)",
                                    self.store.url, holder, self.ttl_s)
                    waited_for = etag_seen
                    time.sleep(min(5.0, max(0.5, float(doc.get("expires", 0)) - time.time() + 0.5)))
                    continue
                log.info("%s: taking over the writer lease of %s (%s)", self.store.url, holder,
                         "process gone" if dead else "expired")
                etag = self._put(etag_seen)
            if etag is not None:
                self._etag = etag
                self._check_conditional()
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
                self._etag = back[1] if back else None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                etag = self._put(self._etag)
            except Exception as e:  # a blip: try again next time, the lease has 2/3 of its ttl left
                log.warning("could not renew the writer lease of %s: %s", self.store.url, e)
                continue
            if etag is None:
                current = self._read()
                who = f"host {current[0].get('host')} pid {current[0].get('pid')}" if current else "nobody"
                self.lost = f"the writer lease of {self.store.url} was taken over by {who}"
                log.error("%s; this process will not commit any more checkpoints", self.lost)
                return
            self._etag = etag

    def verify(self) -> None:
        owner = self._shared
        if owner is not None and owner.lost:
            raise RunLockedError(owner.lost + "; this writer stops (restart it to resume safely)")

    def release(self) -> None:
        if self._shared is None:
            return
        with _mutex:
            lease, n = _held[self.store.url]
            self._shared = None
            if n > 1:
                _held[self.store.url] = (lease, n - 1)
                return
            del _held[self.store.url]
        lease._shutdown()

    def _shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.lost or self._etag is None:
            return
        try:
            if hasattr(self.store, "delete_conditional"):
                self.store.delete_conditional(self.path, self._etag)
            else:
                current = self._read()
                if current and current[0].get("owner") == self._owner:
                    self.store.remove([self.path])
        except Exception as e:  # it expires by itself
            log.warning("could not release the writer lease of %s (it expires in %.0f s): %s",
                        self.store.url, self.ttl_s, e)
