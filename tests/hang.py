"""A hang guard for tests: a body that never ends fails instead of hanging the suite. A guard, not a time
limit: it is set far above what the body needs, since a loaded machine may stop a worker for seconds and a
slow case is not a failure (docs/testing.md: no timed assertions)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Hang(Exception):
    """The guarded body was still running after the guard's limit."""


@contextmanager
def hang_guard(limit: float, what: str = "the guarded code") -> Iterator[None]:
    """Raise :class:`Hang` in the main thread if the body is still running after ``limit`` seconds."""

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{what} still running after {limit} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
