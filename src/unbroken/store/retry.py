"""Retries with exponential backoff and jitter, for transient errors of remote stores.

Transient: connection refused or reset, timeouts, HTTP 5xx / throttling, and other
``OSError``\\ s a server that restarts produces. Not transient (raised at once): a
missing object or bucket, refused credentials, a failed precondition, and our own
library errors. ``deadline_s`` bounds the total time, so a save never hangs forever on
a dead server: it fails with the last error, and the caller decides (a direct remote
save raises, a background upload tries again later).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import UnbrokenError

log = logging.getLogger("unbroken")
T = TypeVar("T")

_PERMANENT_WORDS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
                    "pre-condition", "precondition", "Forbidden", "does not exist")


def is_transient(e: BaseException) -> bool:
    """Whether retrying ``e`` can help (see the module docstring)."""
    if isinstance(e, (UnbrokenError, FileNotFoundError, PermissionError, IsADirectoryError,
                      NotADirectoryError, ValueError, TypeError, KeyError)):
        return False
    text = f"{type(e).__name__}: {e}"
    if any(w in text for w in _PERMANENT_WORDS):
        return False
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return True
    module = type(e).__module__ or ""
    return module.startswith(("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "asyncio"))


@dataclass(frozen=True)
class Retry:
    """How a remote operation is retried: ``deadline_s`` of trying, waits growing from
    ``first_wait_s`` by ``factor`` up to ``max_wait_s``, each with ±25 % jitter."""

    deadline_s: float = 60.0
    first_wait_s: float = 0.2
    max_wait_s: float = 5.0
    factor: float = 2.0

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried while it raises transient errors and the deadline allows."""
        start, wait, attempt = time.monotonic(), self.first_wait_s, 0
        while True:
            attempt += 1
            try:
                return fn()
            except BaseException as e:
                elapsed = time.monotonic() - start
                if not is_transient(e) or elapsed + wait > self.deadline_s:
                    raise
                log.info("%s failed (attempt %d, %s: %s); retrying in %.1f s", what, attempt,
                         type(e).__name__, str(e)[:200], wait)
            time.sleep(wait * random.uniform(0.75, 1.25))
            wait = min(wait * self.factor, self.max_wait_s)
