"""A training process whose launcher died (torchrun's agent, ``unbroken run``) saves at the next step
boundary and exits.

torchrun's elastic agent forwards a preemption signal to its workers and stops them when
it ends. SIGKILLed (an OOM kill of the agent, ``kill -9``, a crashed wrapper), it can do
neither: its workers keep training, keep the run's writer lock, and whatever they do
after the last save is lost when they are finally killed.

So, in a process started by torchrun (``TORCHELASTIC_RUN_ID`` is set) on Linux, the kernel
is asked to send a preemption signal (SIGTERM when watched) when the launcher dies:
``prctl(PR_SET_PDEATHSIG)``. It costs nothing per step and takes the path of a scheduler's
signal: the flag, the save at the next step boundary (all ranks agree on the step), exit 75,
the lock released. The kernel sends it when the *thread* that started the worker ends:
torch elastic starts its workers (``subprocess.Popen`` or ``multiprocessing``, first start
and restarts alike) from the agent's main thread, which lives as long as the agent. The
setting is cleared in children the worker forks (DataLoader workers) and reset when the
last watcher leaves. A launcher that died before this process imported unbroken (the parent
it had then is compared after the request) is noticed at once.

A training process started by ``unbroken run`` (:mod:`unbroken.launch.supervisor`; a spare that became
the training, or a cold start) is the same case: its launcher is the supervisor, which names itself in
``UNBROKEN_SUPERVISOR`` (its pid); a process whose parent is that pid watches it as a torchrun worker
watches its agent (its own children, which inherit the variable, do not: their parent is another).

A training process forked for ``unbroken run`` (its spares are forked by one interpreter, :mod:`unbroken.launch.forker`,
which names itself in ``UNBROKEN_FORKER``) is a child of that forker, not of the supervisor: when its parent is the
forker its environment names, the supervisor ``UNBROKEN_SUPERVISOR`` names is its launcher, watched by a thread on
its pidfd as below (the forker's own death is not the launcher's: the training runs on).

A training process started by a warm torchrun worker (:mod:`unbroken.launch.worker`) is a child of
the spare server, not of the agent: ``UNBROKEN_WARM_CLIENT=WORKER:AGENT`` names the worker torchrun
watches and the agent. There the launcher is the agent; its death is watched by a thread waiting
on the agent's pidfd (and its main thread's state, every second), which sends the requested signal
to this process, and the worker being adopted by another process counts as the agent's death too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading

log = logging.getLogger("unbroken")
_PR_SET_PDEATHSIG = 1
_PARENT = os.getppid()  # the launcher, as this process knew it when unbroken was imported (or was forked)
_current: int = 0  # the signal asked for now (0: none)
_watcher: threading.Thread | None = None  # a warm worker's training: the thread watching the agent
_CLIENT = "UNBROKEN_WARM_CLIENT"
_SUPERVISOR = "UNBROKEN_SUPERVISOR"
_FORKER = "UNBROKEN_FORKER"  # unbroken.launch.forker.MARK (launch/ sits above faults/)


def _forked() -> None:
    global _PARENT
    _PARENT = os.getppid()  # a child forked after the import (a fork server's): its launcher is its parent


os.register_at_fork(after_in_child=_forked)


def under_launcher() -> bool:
    """True in a worker started by torchrun (the elastic agent), or in a training process started by
    ``unbroken run``'s supervisor, on Linux."""
    if not sys.platform.startswith("linux"):
        return False
    return (bool(os.environ.get("TORCHELASTIC_RUN_ID")) or os.environ.get(_SUPERVISOR) == str(_PARENT)
            or _forked_supervisor() is not None)


def died() -> bool:
    """True if this worker's launcher has died: it was adopted by another process since, or the
    launcher's main thread has ended. The kernel sends the death signal when the *thread* that
    started the worker ends; a SIGKILLed agent's other threads may still be exiting then, and
    until the last one has, the worker's parent is unchanged (its main thread a zombie)."""
    if not under_launcher():
        return False
    warm = _warm()
    if warm is not None:
        worker, agent = warm
        return _ended(agent) or _ended(worker) or _parent_of(worker) != agent
    supervisor = _forked_supervisor()
    if supervisor is not None:
        return _ended(supervisor)
    return os.getppid() != _PARENT or _ended(_PARENT)


def _forked_supervisor() -> int | None:
    """The pid of ``unbroken run``'s supervisor when its forker forked this process (the parent this process had
    when it was forked is the forker named in its environment), else ``None``."""
    supervisor = os.environ.get(_SUPERVISOR, "")
    if not supervisor.isdigit() or not _PARENT or os.environ.get(_FORKER) != str(_PARENT):
        return None
    return int(supervisor)


def _watched() -> int | None:
    """The launcher a thread watches (the kernel's death signal cannot: it is not this process's parent): torchrun's
    agent for a warm worker's training, the supervisor for a forked one; ``None`` otherwise."""
    warm = _warm()
    return warm[1] if warm is not None else _forked_supervisor()


def _warm() -> tuple[int, int] | None:
    """``(worker, agent)`` when a warm torchrun worker started this process (read now: a spare imported
    unbroken before it had its launch's environment)."""
    value = os.environ.get(_CLIENT, "")
    try:
        worker, agent = (int(x) for x in value.split(":"))
    except ValueError:
        return None
    return worker, agent


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 1:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _watch(launcher: int) -> None:
    """The thread of a training whose launcher is not its parent: at the launcher's death, send the signal asked
    for then (its pidfd readable: it has ended, whatever its pid names by the time this looks)."""
    try:
        pidfd: int | None = os.pidfd_open(launcher)
    except OSError:
        pidfd = None
    while True:
        if pidfd is not None:
            if select.select([pidfd], [], [], 1.0)[0]:
                break
        else:
            threading.Event().wait(1.0)
        if died():
            break
    if _current:
        os.kill(os.getpid(), _current)


def _ended(pid: int) -> bool:
    """True if process ``pid`` is gone or its main thread has exited (state Z or X in /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    fields = stat[stat.rfind(b")") + 1:].split()  # the name in parentheses may hold spaces
    return not fields or fields[0] in (b"Z", b"X")


def _prctl(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        log.warning("cannot ask to be signalled when the launcher dies (%s): a worker whose launcher (torchrun's "
                    "agent, unbroken run) is SIGKILLed keeps running", e)
        return False
    return True


def watch(sig: signal.Signals | None) -> None:
    """Be sent ``sig`` when the launcher dies (``None``: nothing); a no-op outside torchrun."""
    global _current, _watcher
    want = int(sig) if sig is not None and under_launcher() else 0
    launcher = _watched() if want or _watcher is not None else None
    if launcher is not None or _watcher is not None:  # not the parent: the thread, not the kernel
        _current = want
        if want and _watcher is None and launcher is not None:
            _watcher = threading.Thread(target=_watch, args=(launcher,), name="unbroken-launcher-watch", daemon=True)
            _watcher.start()
        if want and died():
            log.warning("the launcher (pid %d) is gone", launcher or _PARENT)
            os.kill(os.getpid(), want)
        return
    if want == _current or not _prctl(want):
        return
    _current = want
    if want and died():  # it died before the request: nobody will send it
        log.warning("the launcher (pid %d) is gone", _PARENT)
        os.kill(os.getpid(), want)
