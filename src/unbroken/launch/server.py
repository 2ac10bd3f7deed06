"""The spare server of warm torchrun workers: warm spares on one node, handed to the workers torchrun starts.

Started by the first worker (:mod:`.worker`) of a torchrun agent that finds none, detached (a session of its
own), as ``python [FLAGS] -m unbroken.launch.server DIR SPARES AGENT IDLE_S`` with that worker's interpreter,
flags, working folder and environment less the per-launch variables (:data:`.wire.PER_LAUNCH`). It listens on
``DIR/sock`` (:mod:`.wire`) and keeps ``SPARES`` spares (:mod:`.spare`; torchrun's ``LOCAL_WORLD_SIZE``)
with that environment, which have imported torch, ``torch._dynamo``, ``torch.utils.data``,
``torch.distributed`` and numpy (nothing of unbroken: its import reads ``RANK``), and wait. The spares are
forked by the server's forker (:mod:`.forker`: one interpreter that imports these once; a replacement costs
a fork, not a second of CPU per import); without one (``UNBROKEN_SPARES_FORK=0``, or after the forker died or
stopped answering) each spare is a new interpreter that imports them itself.

A worker's request (its training command, working folder, whole environment, standard streams) is taken
by a ready spare when the interpreter, its flags and the environment are the spare's except per-launch
variables; otherwise the answer is ``cold`` with the reason and the worker runs the command itself. A spare
that took a launch is replaced by a new one at once. While the training runs, the worker's connection
carries the signals it forwards; when the training ends its status goes back, and when the connection
closes first (torchrun SIGKILLed the worker) the training's process group is SIGKILLed.

The server ends when its agent has ended (or nothing connected for ``IDLE_S`` seconds) and no training it
started runs; its spares then exit (their socket closes).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from . import wire
from .forks import Forked, Forker, reap
from .spare import read_answer

PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.utils.data", "torch.distributed")
"""What a torchrun spare imports (no unbroken: :mod:`unbroken._support.faultpoints` reads ``RANK`` when
imported; unbroken's own import is about 0.15 s)."""
READY_TIMEOUT_S = 300.0
"""How long a request waits for a spare that is still importing before it is told to start cold."""


def interpreter_flags() -> list[str]:
    """The flags this interpreter was started with (``-u`` for torchrun's workers): ``sys.orig_argv`` up
    to ``-m`` or the script."""
    flags: list[str] = []
    for arg in sys.orig_argv[1:]:
        if arg == "-m" or not arg.startswith("-"):
            break
        flags.append(arg)
    return flags


class Spare:
    """One waiting interpreter with the server's environment, forked by the forker (:mod:`.forker`), or
    started as a new interpreter when there is none; its ``GO`` is a socket."""

    def __init__(self, flags: list[str], forker: Forker | None) -> None:
        self._go, go_child = socket.socketpair()
        self._ready, ready_w = os.pipe()
        self.forker = forker
        forked = forker.fork(go_child.fileno(), ready_w) if forker is not None else None
        self.proc: subprocess.Popen[bytes] | Forked = forked or subprocess.Popen(
            [sys.executable, *flags, "-m", "unbroken.launch.spare", str(go_child.fileno()), str(ready_w),
             ",".join(PRELOAD)], pass_fds=(go_child.fileno(), ready_w), stdin=subprocess.DEVNULL,
            start_new_session=True)
        go_child.close()
        os.close(ready_w)
        self.answer: str | None = None
        self._lock = threading.Lock()

    def wait_ready(self, timeout: float) -> bool:
        """Whether it has imported what it preloads (within ``timeout`` seconds from now). A forked one: once
        its forker has imported, within :data:`.forks.FORK_TIMEOUT_S` (else the forker is marked unresponsive:
        no spare is asked of it again)."""
        forker = self.forker if isinstance(self.proc, Forked) else None
        if forker is not None:
            timeout = forker.ready_timeout(timeout)
        with self._lock:
            ready = self._peek(timeout)
            if forker is not None and self.answer is None:
                forker.unanswered()
        return ready

    def ready_now(self) -> bool:
        """:meth:`wait_ready` without waiting, and ``False`` while another thread waits for it."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._peek(0.0)
        finally:
            self._lock.release()

    def _peek(self, timeout: float) -> bool:
        if self.answer is None:
            self.answer = read_answer(self._ready, timeout)
        return self.answer == "ready" and self.proc.poll() is None

    def go(self, order: dict, fds: list[int]) -> None:
        wire.send(self._go, order, fds)
        self._go.close()

    def started(self) -> bool:
        """Whether its pid is known (a forked one: the forker answered, within a bounded wait)."""
        try:
            return self.proc.pid > 0
        except OSError:
            return False

    def pid(self) -> int:
        """Its pid (0: a forked one the forker has not answered for yet)."""
        return self.proc.known_pid() if isinstance(self.proc, Forked) else self.proc.pid

    def discard(self) -> None:
        """Not needed: its socket closes (a ready spare exits 0); one still importing is killed."""
        self._go.close()
        with self._lock:
            if self.answer is None:  # still importing: no need to wait for it to read its socket's end
                os.close(self._ready)
                self.answer = "discarded"
                self.proc.kill()
        reap(self.proc)


class Server:
    """The accept loop, the pool of spares, one thread per connected worker."""

    def __init__(self, folder: str, spares: int, agent: int, idle_s: float) -> None:
        self.folder, self.size, self.agent, self.idle_s = folder, max(1, spares), agent, idle_s
        self.flags = interpreter_flags()
        self.env = wire.stable_env(dict(os.environ))
        self.lock = threading.Lock()
        self.pool: list[Spare] = []
        self.forker: Forker | None = None
        self.retired: list[Forker] = []
        self.running = 0
        self.last = time.monotonic()
        self.closing = False

    def fill(self) -> None:
        orphans: list[Spare] = []
        with self.lock:
            if self.forker is not None and not self.forker.usable:
                how = "has ended" if not self.forker.up else "does not answer"
                print(f"the spare forker {how}: spares start as new interpreters", file=sys.stderr, flush=True)
                self.retired.append(self.forker)  # closed when the server ends (a stuck one is killed then)
                self.forker = None
                orphans = [s for s in self.pool if isinstance(s.proc, Forked)]
                self.pool = [s for s in self.pool if s not in orphans]
            while not self.closing and len(self.pool) < self.size:
                self.pool.append(Spare(self.flags, self.forker))
        for spare in orphans:
            spare.discard()

    def take(self) -> Spare | None:
        """A ready spare, else the oldest once ready (``None``: none became ready in time)."""
        self.fill()  # after a forker's end: its spares replaced first
        with self.lock:
            ready = [s for s in self.pool if s.ready_now()]
            choice = ready or self.pool
            spare = choice[0] if choice else None
            if spare is not None:
                self.pool.remove(spare)
        self.fill()  # its replacement warms now
        if spare is None or not spare.wait_ready(READY_TIMEOUT_S) or not spare.started():
            if spare is not None:
                spare.discard()
            self.fill()  # a forker found stuck: new interpreters
            return None
        return spare

    def unfit(self, req: dict) -> str | None:
        """Why a spare cannot take this launch (``None``: it can)."""
        if req.get("executable") != sys.executable or req.get("flags") != self.flags:
            return (f"the interpreter {req.get('executable')} {' '.join(req.get('flags') or [])} is not the spares' "
                    f"({sys.executable} {' '.join(self.flags)})")
        env = wire.stable_env(req.get("env") or {})
        differ = sorted(k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k))
        if differ:
            more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
            return f"the environment differs from the spares' in {differ[0]}{more}"
        return None

    def serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            req, fds = wire.recv(conn, max_fds=3)
            conn.settimeout(None)
            if req is None:
                return
            if req.get("op") == "status":
                with self.lock:
                    pool = list(self.pool)
                wire.send(conn, {"ready": sum(s.ready_now() for s in pool), "spares": [s.pid() for s in pool],
                                 "pid": os.getpid()})
                return
            try:
                self.launch(conn, req, fds)
            finally:
                for fd in fds:
                    os.close(fd)
        except (OSError, ValueError):
            pass
        finally:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the thread relaying signals
            except OSError:
                pass
            conn.close()
            with self.lock:
                self.last = time.monotonic()

    def launch(self, conn: socket.socket, req: dict, fds: list[int]) -> None:
        reason = self.unfit(req)
        spare = None if reason else self.take()
        if spare is None:
            wire.send(conn, {"cold": reason or "no spare became ready"})
            return
        with self.lock:
            self.running += 1
        try:
            spare.go({k: req[k] for k in ("argv", "script", "module", "env", "cwd", "client")}, fds)
            proc = spare.proc
            wire.send(conn, {"warm": proc.pid})
            threading.Thread(target=self._relay_signals, args=(conn, proc), daemon=True).start()
            status = proc.wait()
            wire.send(conn, {"status": status})
        finally:
            with self.lock:
                self.running -= 1

    @staticmethod
    def _relay_signals(conn: socket.socket, proc: subprocess.Popen[bytes] | Forked) -> None:
        """Signals the worker forwards; its connection closing before the training ended kills the training."""
        try:
            while True:
                msg, fds = wire.recv(conn)
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    break
                if "signal" in msg and proc.poll() is None:
                    proc.send_signal(int(msg["signal"]))
        except (OSError, ValueError):
            pass
        if isinstance(proc, Forked):
            proc.killpg()
        elif proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the training and its children
            except OSError:
                pass

    def done(self) -> bool:
        with self.lock:
            if self.running:
                return False
            idle = time.monotonic() - self.last > self.idle_s
        return idle or not _alive(self.agent)

    def run(self) -> None:
        path = os.path.join(self.folder, "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.lexists(path):
            os.unlink(path)  # a dead server's (the worker holds the folder's lock while it starts this one)
        listener.bind(path)
        listener.listen(64)
        with open(os.path.join(self.folder, "pid"), "w") as f:
            f.write(str(os.getpid()))
        if os.environ.get("UNBROKEN_SPARES_FORK", "1") != "0":
            self.forker = Forker(self.flags, PRELOAD)
        self.fill()
        try:
            while not self.done():
                ready, _, _ = select.select([listener], [], [], 1.0)
                if not ready:
                    forker = self.forker
                    if forker is not None and not forker.usable:
                        self.fill()  # its spares replaced by new interpreters
                    continue
                conn, _ = listener.accept()
                try:
                    wire.check_peer(conn)
                except wire.Refused:
                    conn.close()
                    continue
                with self.lock:
                    self.last = time.monotonic()
                threading.Thread(target=self.serve, args=(conn,), daemon=True).start()
        finally:
            with self.lock:
                self.closing = True
                pool, self.pool = self.pool, []
            listener.close()
            for spare in pool:
                spare.discard()
            for forker in [*self.retired, *([self.forker] if self.forker is not None else [])]:
                forker.close()
            self._clean()

    def _clean(self) -> None:
        """Remove the socket and pid; the whole folder too once the agent is gone (no worker of it can come)."""
        names = ["sock", "pid"]
        if not _alive(self.agent):
            log = os.path.join(self.folder, "log")
            names += ["lock"] + (["log"] if os.path.isfile(log) and os.path.getsize(log) == 0 else [])
        for name in names:
            try:
                os.unlink(os.path.join(self.folder, name))
            except OSError:
                pass
        try:
            os.rmdir(self.folder)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 1:].split()
    return bool(fields) and fields[0] not in (b"Z", b"X")


def main(argv: list[str]) -> int:
    folder, spares, agent, idle_s = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if os.fork():  # detached: the worker that started it waits only for this first process
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(os.path.join(folder, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd, to in ((0, devnull), (1, devnull), (2, log)):  # no stream of the worker's stays open here
        os.dup2(to, fd)
    Server(folder, spares, agent, idle_s).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
