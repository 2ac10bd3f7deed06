"""Work that must run when the interpreter exits normally, while thread pools still work.

A script that never calls ``Checkpointer.close()`` still gets its background save committed and
its uploads to a remote tier finished at exit. Both need thread pools, but ``atexit`` handlers
run *after* Python has shut ``concurrent.futures`` down ("cannot schedule new futures after
interpreter shutdown": the upload failed and the exit waited for ``close_timeout_s``). Hooks of
:mod:`threading` run before that, the last registered first, so one registered after
``concurrent.futures`` registered its own runs ahead of it.
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

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading exit hooks")
        register(hook)
    except RuntimeError:  # already shutting down, or an interpreter without the hook
        atexit.register(hook)
    return fn
