"""A torchrun worker whose launcher died saves at the next step boundary and exits.

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
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger("unbroken")
_PR_SET_PDEATHSIG = 1
_PARENT = os.getppid()  # the launcher, as this process knew it when unbroken was imported
_current: int = 0  # the signal asked for now (0: none)


def under_launcher() -> bool:
    """True in a worker started by torchrun (the elastic agent) on Linux."""
    return sys.platform.startswith("linux") and bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def died() -> bool:
    """True if this worker's launcher has died: it was adopted by another process since, or the
    launcher's main thread has ended. The kernel sends the death signal when the *thread* that
    started the worker ends; a SIGKILLed agent's other threads may still be exiting then, and
    until the last one has, the worker's parent is unchanged (its main thread a zombie)."""
    return under_launcher() and (os.getppid() != _PARENT or _ended(_PARENT))


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
        log.warning("cannot ask to be signalled when the launcher dies (%s): a worker whose torchrun agent is "
                    "SIGKILLed keeps running", e)
        return False
    return True


def watch(sig: signal.Signals | None) -> None:
    """Be sent ``sig`` when the launcher dies (``None``: nothing); a no-op outside torchrun."""
    global _current
    want = int(sig) if sig is not None and under_launcher() else 0
    if want == _current or not _prctl(want):
        return
    _current = want
    if want and died():  # it died before the request: nobody will send it
        log.warning("the launcher (pid %d) is gone", _PARENT)
        os.kill(os.getpid(), want)
