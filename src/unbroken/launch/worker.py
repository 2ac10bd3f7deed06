"""A torchrun worker that starts from a warm spare: ``torchrun ... -m unbroken.launch.worker train.py ARGS``.

torchrun starts this module instead of the script (``-m``; a module for ``-m`` goes as ``-m pkg.train ARGS``).
It imports no torch. It connects to the node's spare server (:mod:`.server`; the first worker of an agent
starts it, detached) and asks it to run ``python [FLAGS] train.py ARGS`` — the flags torchrun gave this
interpreter (``-u``) — with this process's working folder, environment and standard streams: a spare that
has imported torch becomes the training process (:mod:`.spare`). This process stays the one torchrun
watches: it forwards SIGTERM, SIGINT, SIGUSR1 and SIGHUP to the training, and exits as the training exited
(its status, or killed by the same signal). When it dies (torchrun SIGKILLs it), the training is SIGKILLed
too (by the server, and by the training itself, which waits on this process's pidfd).

The training's environment has ``UNBROKEN_WARM_CLIENT=PID:AGENT`` added: its launcher, for
:mod:`unbroken.faults.launcher`, is torchrun's agent, this process's parent, not the server.

When a spare cannot take the launch — the command is not ``script`` or ``-m module`` for this interpreter,
the environment differs from the spares' in a variable that is not per-launch (:data:`.wire.PER_LAUNCH`),
no safe socket folder (:mod:`.wire`), no spare became ready — this process *becomes* the command
(``exec``: the same pid), saying why once on stderr: the cold start torchrun would have made.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from typing import NoReturn

from . import wire
from .command import Command, parse
from .server import READY_TIMEOUT_S, interpreter_flags

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
START_TIMEOUT_S = 60.0
"""How long a worker waits for the folder's lock and for a server it started to listen."""
IDLE_S = 600.0
"""A server with no worker connected for this long ends even if its agent lives (``UNBROKEN_SPARES_IDLE_S``)."""


def say(message: str) -> None:
    print(f"unbroken worker (pid {os.getpid()}): {message}", file=sys.stderr, flush=True)


def cold(cmd: Command, reason: str) -> NoReturn:
    """Become the command (the same pid), after saying why no spare runs it."""
    say(f"cold start: {reason}")
    if cmd.executable is None:
        os.execvp(cmd.argv[0], cmd.argv)
    os.execv(cmd.executable, cmd.argv)


def _lock(folder: str) -> int:
    fd = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise TimeoutError(f"{folder}/lock held for {START_TIMEOUT_S:.0f} s") from None
            time.sleep(0.02)


def _connect(path: str) -> socket.socket | None:
    if not wire.check_socket(path):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    try:
        wire.check_peer(sock)
    except wire.Refused:
        sock.close()
        raise
    return sock


def server_folder(env: dict[str, str] | None = None) -> str:
    """This worker's server's folder (created, checked: :mod:`.wire`)."""
    env = dict(os.environ) if env is None else env
    return wire.server_dir(env.get("TORCHELASTIC_RUN_ID", ""), os.getppid(), sys.executable, env)


def connect(flags: list[str]) -> socket.socket:
    """A connection to this agent's spare server, started (detached) when none listens."""
    folder = server_folder()
    path = os.path.join(folder, "sock")
    lock = _lock(folder)
    try:
        sock = _connect(path)
        if sock is not None:
            return sock
        log = os.open(os.path.join(folder, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            subprocess.Popen(
                [sys.executable, *flags, "-m", "unbroken.launch.server", folder,
                 os.environ.get("LOCAL_WORLD_SIZE", "1"), str(os.getppid()),
                 os.environ.get("UNBROKEN_SPARES_IDLE_S", str(IDLE_S))],
                env=wire.stable_env(dict(os.environ)), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=log, start_new_session=True).wait(timeout=START_TIMEOUT_S)
        finally:
            os.close(log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            sock = _connect(path)
            if sock is not None:
                return sock
            time.sleep(0.02)
        raise TimeoutError(f"the spare server did not listen within {START_TIMEOUT_S:.0f} s (its log: {folder}/log)")
    finally:
        os.close(lock)


def status(folder: str, timeout: float = 10.0) -> dict | None:
    """The state of the server in ``folder`` (``ready``: spares ready; ``spares``: their pids; ``pid``: the
    server's), or ``None`` when none listens. For tests and benchmarks."""
    sock = _connect(os.path.join(folder, "sock"))
    if sock is None:
        return None
    with sock:
        sock.settimeout(timeout)
        wire.send(sock, {"op": "status"})
        reply, _ = wire.recv(sock)
        return reply


def _mirror(status: int) -> NoReturn:
    """Exit as the training did: its status, or killed by the same signal."""
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # (their handling cannot be set, nor needs to be)
            signal.signal(-status, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-status])
        os.kill(os.getpid(), -status)
        time.sleep(1)
        os._exit(128 - status)
    sys.exit(status)


def main(argv: list[str]) -> NoReturn:
    flags = interpreter_flags()
    cmd = parse([sys.executable, *flags, *argv])
    if cmd.cold:
        cold(cmd, cmd.cold)
    try:
        conn = connect(flags)
    except (wire.Refused, OSError) as e:
        cold(cmd, f"no spare server ({e})")
    env = dict(os.environ, **{wire.CLIENT: f"{os.getpid()}:{os.getppid()}"})
    try:
        wire.send(conn, {"argv": cmd.main_argv(), "script": cmd.script, "module": cmd.module, "env": env,
                         "cwd": os.getcwd(), "client": os.getpid(), "executable": sys.executable, "flags": flags},
                  [0, 1, 2])
        conn.settimeout(READY_TIMEOUT_S + 30)
        reply, _ = wire.recv(conn)
    except (OSError, ValueError) as e:
        cold(cmd, f"the spare server did not answer ({e})")
    if reply is None or "warm" not in reply:
        cold(cmd, (reply or {}).get("cold") or "the spare server ended")
    pid = int(reply["warm"])
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except OSError:
        pidfd = None  # it has ended already: its status follows
    say(f"warm start: the spare {pid} runs {' '.join(cmd.argv[1:])}")

    def forward(signum: int, frame: object) -> None:
        try:
            wire.send(conn, {"signal": signum})
        except OSError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    conn.settimeout(None)
    msg, _ = wire.recv(conn)
    if msg is None or "status" not in msg:
        say("the spare server ended before the training: killing the training")
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        _mirror(1)
    _mirror(int(msg["status"]))


if __name__ == "__main__":
    main(sys.argv[1:])
