"""The spare forker: one interpreter of the spare server's (or of ``unbroken run``'s supervisor's) that imports what
a spare preloads, once, and forks every spare from it.

A spare started as a new interpreter spends 2-2.5 s of CPU importing torch. The server replaces a spare
as soon as it takes a launch, so after a failure every rank's replacement imported torch right while the
restarted ranks redid their lost steps: on a node whose ranks use every core (the 2-core machine of
docs/benchmarks.md) the steps after a warm restart ran at half speed, and the import took back most of what
the warm start had saved. A forked spare costs a ``fork`` (milliseconds), and the spares share the forker's
pages (copy on write) instead of holding one copy of torch's import each.

The server (:mod:`.server`) starts it as ``python [FLAGS] -m unbroken.launch.forker CTRL MODULES DETACHED``, with
the spares' interpreter, flags and environment; ``CTRL`` is the forker's end of a unix socket pair. ``unbroken
run``'s supervisor (:mod:`.supervisor`) starts one too, not detached (``DETACHED`` 0): the forker and its spares
stay in the job's session and process group, as spares the supervisor starts do, with its standard input. It imports
``MODULES`` (never CUDA: importing torch creates no CUDA context) and serves ``{"fork": ID}`` requests, each
bringing a spare's ``GO`` socket and ``READY`` pipe (:mod:`.spare`): it calls ``gc.freeze()`` (a child then
neither collects nor copies the ~300,000 objects of torch's import), forks, and answers ``{"forked": ID,
"pid": PID}`` with a pidfd of the child. The child closes what is the forker's, starts a session of its own
when detached (as a spare started by the server does), and is the spare from there on (:func:`.spare.serve`):
it says ``ready`` and waits for its order. The forker is the spares' parent: it reaps them and reports each one's
end, ``{"exit": PID, "code": RETURNCODE}`` (``-N``: killed by signal N, as :class:`subprocess.Popen`'s).

A clean parent: the forker runs no training code and touches nothing but its socket; nothing of a training
process, dead or alive, is in a spare. Each child gets fresh random seeds (Python's ``random`` reseeds at a
fork; numpy's global generator is reseeded here), as a new interpreter would.

The forker ignores SIGINT, SIGTERM, SIGHUP and SIGUSR1 (a signal to the job's whole process group is the
training's: the forker must outlive it to report the training's status — 75 after a preemption's save); a child
gets SIGTERM, SIGHUP and SIGUSR1 back at their defaults, SIGINT once it runs its script (:mod:`.spare`). Its
environment names it (``UNBROKEN_FORKER``, its pid), for :mod:`unbroken.faults.launcher`: a training forked for
``unbroken run`` watches the supervisor, its launcher, though its parent is the forker.

The forker ends when its socket closes (its owner is done or gone); the spares it forked do not end with it
(a waiting one exits when its ``GO`` closes, a training with its worker). When a forker cannot import, each
request is answered by ``failed ...`` on its ``READY`` pipe, as a spare that cannot import answers.

Its owner's side (the process started, spares asked for, their ends read) is :mod:`.forks`.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import signal
import socket
import sys

from . import wire
from .spare import serve

SPARED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
"""The signals the forker ignores (a job's, sent to its process group); a forked child resets all but SIGINT (its
script's, once it runs: :mod:`.spare`)."""
MARK = "UNBROKEN_FORKER"
"""The variable naming the forker (its pid) in its environment and its children's."""


def main(argv: list[str]) -> int:
    ctrl = socket.socket(fileno=int(argv[0]))
    modules = [m for m in argv[1].split(",") if m]
    detached = len(argv) < 3 or argv[2] != "0"
    for sig in SPARED:  # as a waiting spare for SIGINT: a Ctrl-C is the training's
        signal.signal(sig, signal.SIG_IGN)
    os.environ[MARK] = str(os.getpid())
    failed = None
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - answered to every request (its owner then starts cold)
        failed = f"failed {type(e).__name__}: {e}\n"
    try:
        wire.send(ctrl, {"up": failed is None})
        spare = _serve(ctrl, failed, detached)
    except OSError:
        return 0  # the owner went away mid-message
    if spare is None:
        return 0  # the owner is done (or gone): its spares are not this process's concern
    return serve(*spare)  # a forked child, outside everything of the forker's: the spare from here on


def _serve(ctrl: socket.socket, failed: str | None, detached: bool) -> tuple[int, int] | None:
    """Fork spares until the socket closes (``None``); in a child, its ``GO`` and ``READY``."""
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        ready, _, _ = select.select([ctrl.fileno(), *children], [], [])
        for fd in ready:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                wire.send(ctrl, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if ctrl.fileno() not in ready:
            continue
        msg, fds = wire.recv(ctrl, max_fds=2)
        if msg is None:
            return None
        if len(fds) != 2 or "fork" not in msg:
            for fd in fds:
                os.close(fd)
            continue
        go, ready_w = fds
        if failed is not None:
            _answer(ready_w, failed)
            os.close(go)
            wire.send(ctrl, {"forked": msg["fork"], "pid": 0})
            continue
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the spare: nothing of the forker's but what it imported
            ctrl.close()
            for fd in children:
                os.close(fd)
            if detached:
                os.setsid()
            for sig in SPARED[1:]:
                signal.signal(sig, signal.SIG_DFL)
            _reseed()
            return go, ready_w
        os.close(go)
        os.close(ready_w)
        pidfd = os.pidfd_open(pid)
        children[pidfd] = pid
        wire.send(ctrl, {"forked": msg["fork"], "pid": pid}, [pidfd])


def _answer(fd: int, what: str) -> None:
    try:
        os.write(fd, what.encode())
    except OSError:
        pass
    os.close(fd)


def _reseed() -> None:
    """Fresh seeds for what a new interpreter seeds from the system at import (Python's ``random`` does so
    itself at a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
