"""Background saves: the snapshot is taken in the training loop, writing and committing it
happen in one background thread (``Checkpointer(..., async_save=True)``).

The rules, which the :class:`~unbroken.Checkpointer` follows:

* **At most one save in flight.** A save that finds one still writing waits for it to
  commit first (the backpressure rule: saving more often than the storage can take slows
  the loop down to the storage's pace, it never queues unbounded copies of the state).
  The staging buffers of the snapshot are therefore reused from save to save.
* **Errors are never silent.** A failed background save is raised in the training loop:
  by the next :meth:`~unbroken.Checkpointer.step` that finds it finished, by the next save,
  by :meth:`~unbroken.Checkpointer.flush`/``wait()`` and by ``close()``. Emergency and
  preemption saves wait for the one in flight and log its error instead, so that their own
  (synchronous) checkpoint is still written.
* **Nothing is lost at exit.** ``close()`` (called by ``with``, by ``finally`` blocks and, for
  a Checkpointer left open, at interpreter exit) waits for the save in flight to commit.
  Only a SIGKILL or a power loss can stop it, and then the previous checkpoint is the newest:
  a commit is atomic.
* Events, retention and the run index are handled in the training thread, when the
  finished save is collected: the background thread only writes and commits.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
M = TypeVar("M")


class BackgroundSaves(Generic[M, T]):
    """One background thread and at most one job in flight, with its metadata."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[T] | None = None
        self._meta: M | None = None
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def finished(self) -> bool:
        """True when there is a job and it is done (successfully or not)."""
        return self._future is not None and self._future.done()

    def submit(self, job: Callable[[], T], meta: M) -> None:
        with self._lock:
            if self._future is not None:
                raise RuntimeError("a background save is already in flight; collect it first")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-save")
            self._future = self._pool.submit(job)
            self._meta = meta

    def collect(self) -> tuple[M, T] | None:
        """Wait for the job in flight; its metadata and result, or ``None`` if there was none.
        Re-raises the job's exception (the job is forgotten either way)."""
        with self._lock:
            future, meta = self._future, self._meta
            self._future = self._meta = None
        if future is None:
            return None
        result = future.result()
        assert meta is not None
        return meta, result

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

