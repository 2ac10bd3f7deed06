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
* **Lazy snapshots** (``async_save="lazy"``): the thread first makes the copies the snapshot
  deferred, then waits for the training thread's verdict on them (:mod:`unbroken.checkpoint.background.lazy`)
  before it writes; a bad verdict is handed to the job, which commits nothing.
* **Several ranks**: every rank's thread runs the commit protocol over a gloo group of its
  own (not the one the loop's per-step collectives use), and a failed save is raised by the
  next save, on every rank at the same step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from .lazy import StepGate

T = TypeVar("T")
M = TypeVar("M")


def in_thread(job: Callable[[], T]) -> tuple[Future[T], threading.Thread]:
    """Run ``job`` in a new daemon thread named ``unbroken-save``; its future and thread.

    A daemon, so that the interpreter's exit does not join it before the ``atexit`` handlers
    run: those (the Checkpointer's, ``unbroken.save``'s) wait for the commit themselves, and a
    lazy save's writer waits for a judgement only the exit handler gives."""
    future: Future[T] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(job())
            except BaseException as e:  # noqa: BLE001 - handed to the thread that collects
                future.set_exception(e)

    thread = threading.Thread(target=run, name="unbroken-save", daemon=True)
    thread.start()
    return future, thread


class BackgroundSaves(Generic[M, T]):
    """At most one job in flight, with its metadata, each in its own thread (:func:`in_thread`)."""

    def __init__(self) -> None:
        self._future: Future[T] | None = None
        self._meta: M | None = None
        self._thread: threading.Thread | None = None
        self._gate: StepGate | None = None
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def finished(self) -> bool:
        """True when there is a job and it is done (successfully or not)."""
        return self._future is not None and self._future.done()

    def submit(self, job: Callable[[BaseException | None], T], meta: M, gate: StepGate | None = None) -> None:
        """Run ``job(broken)`` in a new thread. With a lazy snapshot's ``gate``, the thread first
        makes the deferred copies, then waits for the training thread's verdict on them; a bad
        verdict (or a failed copy) is passed to the job as ``broken``, which must not commit
        (with several ranks it still takes part in the collective, so that no rank commits)."""
        def gated() -> T:
            broken: BaseException | None = None
            if gate is not None:
                try:
                    gate.copy()  # while the next forward/backward runs
                    gate.verdict()
                except Exception as e:  # noqa: BLE001 - handed to the job
                    broken = e
            return job(broken)

        with self._lock:
            if self._future is not None:
                raise RuntimeError("a background save is already in flight; collect it first")
            future, self._thread = in_thread(gated)
            self._future, self._meta, self._gate = future, meta, gate

    def collect(self) -> tuple[M, T] | None:
        """Wait for the job in flight; its metadata and result, or ``None`` if there was none.
        Re-raises the job's exception (the job is forgotten either way)."""
        with self._lock:
            future, meta, gate = self._future, self._meta, self._gate
            self._future = self._meta = self._gate = None
        if future is None:
            return None
        try:
            if gate is not None:
                gate.judge()  # the writer waits for this verdict before it writes
            result = future.result()
        finally:
            if gate is not None:
                gate.close()
        assert meta is not None
        return meta, result

    def shutdown(self) -> None:
        """Wait for the last job's thread to end (after :meth:`collect`)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

