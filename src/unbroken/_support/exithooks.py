"""Work that must run when the interpreter exits normally, while thread pools still work.

A script that never calls ``Checkpointer.close()`` still gets its background save committed and
its uploads to a remote tier finished at exit. Both need thread pools, but ``atexit`` handlers
run *after* Python has shut ``concurrent.futures`` down ("cannot schedule new futures after
interpreter shutdown": the upload failed and the exit waited for ``close_timeout_s``). Hooks of
:mod:`threading` run before that, the last registered first, so one registered after
``concurrent.futures`` registered its own runs ahead of it.

Two kinds: :func:`at_exit` for what a running process registers (a hook of *this* process, never
run in a child it forks), and :func:`at_process_exit` for a module's own state (registered when the
module is imported, run at the exit of every process that has the module, each acting on what it made
itself: the module forgets its parent's state in a forked child).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook first: ours run before it
import os
import threading
from collections.abc import Callable


def at_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` to run at normal exit of *this* process, before thread pools shut down;
    returns ``fn``. Never in a forked child (a DataLoader worker): :mod:`threading`'s exit hooks
    also run when a ``multiprocessing`` child ends, and closing the parent's Checkpointers there
    would wait on futures and threads that do not exist in the child and write the parent's files."""
    owner = os.getpid()

    def hook() -> None:
        if os.getpid() == owner:
            fn()

    _register(hook)
    return fn


def _register(hook: Callable[[], None]) -> None:
    """A :mod:`threading` exit hook, or an ``atexit`` one when there is none (or it is too late for one)."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading exit hooks")
        register(hook)
    except RuntimeError:  # already shutting down, or an interpreter without the hook
        atexit.register(hook)


def at_process_exit(forget: Callable[[], None]) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Decorator for a module's exit hook over the module's own state (saves in flight, leases held, sessions
    open): the hook runs at the normal exit of the importing process and of every process forked from it,
    and ``forget`` runs first thing in each forked child (``os.register_at_fork``) so that the child holds
    nothing of its parent's: a DataLoader worker never waits on or releases its parent's work, while a
    child forked before it made anything (a fork server's, with unbroken imported) closes its own."""
    os.register_at_fork(after_in_child=forget)

    def register(fn: Callable[[], None]) -> Callable[[], None]:
        _register(fn)
        return fn

    return register
