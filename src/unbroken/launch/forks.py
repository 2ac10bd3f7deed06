"""The owner's side of a spare forker (:mod:`.forker`): :class:`Forker` starts the forker process and asks it for
spares; :class:`Forked` is one forked spare as its owner — the spare server (:mod:`.server`) or ``unbroken run``'s
supervisor (:mod:`.supervisor`) — sees it, the part of :class:`subprocess.Popen` they use, every wait bounded."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import wire

LOST = 1
"""The return code given to a forked process whose forker died before reporting its end (its status is unknown:
another parent reaped it)."""
FORK_TIMEOUT_S = 10.0
"""How long the owner (server, supervisor) waits for a fork (the spare's ``ready`` and the forker's answer) once the
forker has imported, and for the forker's report of an end it has seen: a fork takes milliseconds; a forker that
does not answer (stopped) is retired — an end is then read from the zombie, and spares start as new interpreters."""


class Forked:
    """A spare forked by a :class:`Forker`, as its owner sees it: the part of :class:`subprocess.Popen`'s
    interface it uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``), its end reported by the forker.

    The end is waited for on the process's pidfd, then the forker's report for at most :data:`FORK_TIMEOUT_S`:
    a forker that does not report it (stopped) cannot have reaped it either, and its status is read from the
    zombie (``/proc/PID/stat``'s ``exit_code``); the forker is then no longer asked for spares (``on_stuck``).
    A process whose forker died is reaped by another parent: its end is seen, its status is :data:`LOST`."""

    def __init__(self, on_stuck: Callable[[], None]) -> None:
        self._pid = 0
        self._pidfd: int | None = None
        self._on_stuck = on_stuck
        self._orphaned = False
        self._forgotten = False
        self._started = threading.Event()
        self._ended = threading.Event()
        self._fd_lock = threading.Lock()  # the pidfd is closed once waited for, never while in use
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        """Its pid, once the forker has answered (bounded wait; ``OSError`` if it never did)."""
        if not self._started.wait(FORK_TIMEOUT_S) or not self._pid:
            raise ProcessLookupError("the forker did not fork this spare")
        return self._pid

    def known_pid(self) -> int:
        """Its pid, or 0 while the forker has not answered."""
        return self._pid

    def started(self, pid: int, pidfd: int | None) -> None:
        with self._fd_lock:
            if self._forgotten and pidfd is not None:
                os.close(pidfd)
                pidfd = None
            self._pid, self._pidfd = pid, pidfd
        self._started.set()
        if not pid:
            self.ended(3)  # not forked: the forker could not import (its READY says why)

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()
        self._started.set()

    def lost(self) -> None:
        """The forker died: no end will be reported (one not forked yet has ended: it never will be)."""
        self._orphaned = True
        if self._pidfd is None:
            self.ended(LOST)
        self._started.set()

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout

        def left(cap: float | None = None) -> float | None:
            rest = None if deadline is None else max(0.0, deadline - time.monotonic())
            return cap if rest is None else rest if cap is None else min(cap, rest)

        pidfd = self._pidfd if self._started.wait(left()) else None
        if pidfd is not None and not self._ended.is_set() and select.select([pidfd], [], [], left())[0]:
            if self._orphaned or not self._ended.wait(left(FORK_TIMEOUT_S)):
                self._unreported()
        if not self._ended.wait(left()):
            raise subprocess.TimeoutExpired("spare", timeout or 0.0)
        with self._fd_lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        assert self.returncode is not None
        return self.returncode

    def forget(self, timeout: float) -> None:
        """For a spare not needed (its ``GO`` closed): wait for its end, not its status; SIGKILLed if it has not
        ended within ``timeout`` seconds. One not forked yet is left alone: forked, it ends at once."""
        with self._fd_lock:
            pidfd, self._pidfd, self._forgotten = self._pidfd, None, True
        if pidfd is None:
            return
        if not select.select([pidfd], [], [], timeout)[0]:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            select.select([pidfd], [], [], timeout)
        os.close(pidfd)

    def _unreported(self) -> None:
        """Ended, unreported: the status from its zombie while its parent, the forker, has not reaped it."""
        code = LOST
        try:
            with open(f"/proc/{self._pid}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 1:].split()  # fields 3 on: the state, ... field 52 the exit code
            if not self._orphaned and fields[0] == b"Z":
                code = os.waitstatus_to_exitcode(int(fields[49]))
        except (OSError, ValueError, IndexError):
            pass
        self.ended(code)
        if not self._orphaned:
            self._on_stuck()

    def killpg(self) -> None:
        """SIGKILL its process group (its session: the training and its children) while it runs (its pidfd not
        yet readable: the group named by its pid is still its own)."""
        with self._fd_lock:
            if self._pidfd is not None and not select.select([self._pidfd], [], [], 0)[0]:
                try:
                    os.killpg(self._pid, signal.SIGKILL)
                except OSError:
                    pass

    def send_signal(self, sig: int) -> None:
        with self._fd_lock:
            if self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forker:
    """The owner's side of the forker process (the spare server's, or ``unbroken run``'s supervisor's): :meth:`fork`
    a spare, the forker's reports read by a thread."""

    def __init__(self, flags: list[str], modules: tuple[str, ...], *, executable: str = sys.executable,
                 env: dict[str, str] | None = None, detached: bool = True) -> None:
        """A forker of ``executable`` (this interpreter) with ``flags`` and ``env`` (this environment) importing
        ``modules``; ``detached``: in a session of its own, its standard input ``/dev/null``, as the server's
        spares (else in this process's group and with its standard input, as ``unbroken run``'s training)."""
        self._sock, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [executable, *flags, "-m", "unbroken.launch.forker", str(child.fileno()), ",".join(modules),
             "1" if detached else "0"],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL if detached else None, env=env,
            start_new_session=detached)
        child.close()
        self._lock = threading.Lock()
        self._asked: dict[int, Forked] = {}
        self._running: dict[int, Forked] = {}
        self._next = 0
        self.up = True
        """``False`` once the forker has ended (its socket closed)."""
        self.stuck = False
        """``True`` once it left a fork or an end unanswered for :data:`FORK_TIMEOUT_S` (stopped): not used again."""
        self.imported = threading.Event()
        """Set once the forker has imported (or failed to, or ended): from then on a fork is quick."""
        threading.Thread(target=self._read, name="unbroken-forker", daemon=True).start()

    def fork(self, go: int, ready: int) -> Forked | None:
        """A spare forked with these descriptors (the forker gets copies), or ``None`` once the forker is gone."""
        with self._lock:
            if not self.up:
                return None
            self._next += 1
            spare = self._asked[self._next] = Forked(self.unresponsive)
            try:
                wire.send(self._sock, {"fork": self._next}, [go, ready])
            except OSError:
                del self._asked[self._next]
                return None
        return spare

    def _read(self) -> None:
        while True:
            try:
                msg, fds = wire.recv(self._sock, max_fds=1)
            except (OSError, ValueError):
                msg, fds = None, []
            if msg is None:
                break
            self._report(msg, fds)
        with self._lock:
            self.up = False
            self.imported.set()
            left = [*self._asked.values(), *self._running.values()]
            self._asked.clear()
            self._running.clear()
        for spare in left:
            spare.lost()

    def _report(self, msg: Any, fds: list[int]) -> None:
        if "up" in msg:
            self.imported.set()
            return
        with self._lock:
            if "forked" in msg:
                spare = self._asked.pop(int(msg["forked"]), None)
                pid = int(msg["pid"])
                if spare is not None and pid:
                    self._running[pid] = spare
            else:
                spare, pid = self._running.pop(int(msg.get("exit", 0)), None), 0
        if spare is None:
            for fd in fds:
                os.close(fd)
        elif "forked" in msg:
            spare.started(pid, fds[0] if fds else None)
        else:
            spare.ended(int(msg["code"]))

    def ready_timeout(self, timeout: float) -> float:
        """How long to wait for a spare forked by it to say ``ready``, out of ``timeout`` seconds: once the forker
        has imported (waited for here, within ``timeout``), a fork takes milliseconds: :data:`FORK_TIMEOUT_S` at
        most. A spare that has not answered by then and whose forker has imported: :meth:`unresponsive`."""
        start = time.monotonic()
        self.imported.wait(max(0.0, timeout))
        return min(timeout - (time.monotonic() - start), FORK_TIMEOUT_S)

    def unanswered(self) -> None:
        """A spare forked by it did not say ``ready`` within :meth:`ready_timeout`: once it has imported, that is
        the forker's fault (:meth:`unresponsive`)."""
        if self.imported.is_set():
            self.unresponsive()

    @property
    def usable(self) -> bool:
        """Whether spares may still be asked of it: it runs and has answered in time."""
        return self.up and not self.stuck

    def unresponsive(self) -> None:
        """It left a fork or an end unanswered: no spare is asked of it again (it is not killed: the ends of the
        trainings it forked are read from their zombies until then; :meth:`close` kills it)."""
        self.stuck = True

    def close(self) -> None:
        """The forker exits (its socket closes); forked spares live on (see the module docstring)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        reap(self.proc)
        self._sock.close()


def reap(proc: subprocess.Popen[Any] | Forked, timeout: float = 5.0) -> None:
    """Wait for the end of a process that was told to end (its socket closed), SIGKILLed if it has not ended
    within ``timeout`` seconds; a forked one: its end, not its status (:meth:`Forked.forget`)."""
    if isinstance(proc, Forked):
        proc.forget(timeout)
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
