"""The spare: an interpreter that has imported torch and waits to become the training process.

Started by the supervisor (:mod:`.supervisor`) as ``python [FLAGS] -m unbroken.launch.spare GO READY
MODULES``, with the job's environment, working folder and standard streams. It imports ``MODULES``
(torch and what ``--preload`` adds; never CUDA: importing torch creates no CUDA context, so a waiting
spare holds no GPU memory), says ``ready`` on the file descriptor ``READY``, and blocks reading ``GO``.

- A line on ``GO`` (JSON: the script or module and ``sys.argv``) makes it the training process: it runs
  the script as ``python SCRIPT`` does (``runpy``, ``__name__ == "__main__"``, ``sys.path[0]`` the
  script's folder; ``-m``: the working folder), and its exit status is the script's.
- End of file on ``GO`` (the supervisor closed it, or died) makes it exit 0 at once.
- ``GO`` a unix socket (the spare server of warm torchrun workers, :mod:`.server`): the order also brings
  the launch's environment (``os.environ`` replaced), working folder, standard streams (descriptors passed
  with it, made 0, 1 and 2) and the pid of the worker torchrun watches (:mod:`.worker`): when that process
  ends, this one is SIGKILLed (a thread waits on its pidfd), whatever its parent does.

Nothing of a dead training process is in it: it is a new process image, started before the failure.
While it waits, SIGINT is ignored (a Ctrl-C at the terminal is the training's, not the spare's); once it
runs the script, Python's own handling is back.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import stat
import sys
import threading


def read_answer(fd: int, timeout: float) -> str | None:
    """The supervisor's (or server's) end of ``READY``: the spare's answer — ``ready``, ``failed <error>``, or
    ``ended`` when it exited without one — or ``None`` when it has not answered within ``timeout`` seconds.
    ``fd`` is closed once answered."""
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
    if not ready:
        return None
    answer = os.read(fd, 4096).decode(errors="replace").strip() or "ended"
    os.close(fd)
    return answer


def _tell(fd: int, what: str) -> bool:
    """Write ``what`` to the supervisor; ``False`` when it no longer listens (the pipe's reader is closed)."""
    try:
        os.write(fd, what.encode())
    except BrokenPipeError:
        return False
    return True


def main(argv: list[str]) -> int:
    go_fd, ready_fd, modules = int(argv[0]), int(argv[1]), [m for m in argv[2].split(",") if m]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - told to the supervisor, which then starts the command cold
        _tell(ready_fd, f"failed {type(e).__name__}: {e}\n")
        return 3
    return serve(go_fd, ready_fd)


def serve(go_fd: int, ready_fd: int) -> int:
    """Say ``ready`` on ``ready_fd``, wait for the order on ``go_fd`` and run it (what a spare does once its
    imports are done; also a spare forked by :mod:`.forker`). Returns the exit status when not needed."""
    if not _tell(ready_fd, "ready\n"):
        return 0  # the supervisor stopped listening (it is done, or gone): not needed
    os.close(ready_fd)
    if stat.S_ISSOCK(os.fstat(go_fd).st_mode):
        order = _take_launch(go_fd)
        if order is None:
            return 0  # not needed: the server is done (or gone)
    else:
        with os.fdopen(go_fd, "rb") as go:
            line = go.readline()
        if not line:
            return 0  # not needed: the supervisor is done (or gone)
        order = json.loads(line)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = list(order["argv"])
    if order.get("module"):
        sys.path[0] = os.getcwd()
        runpy.run_module(order["module"], run_name="__main__", alter_sys=True)
    else:
        script = order["script"]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0


def _take_launch(go_fd: int) -> dict | None:
    """The server's order and what comes with it: the launch's environment, folder and streams; the death of
    its worker process becomes this one's."""
    from .wire import recv

    with socket.socket(fileno=go_fd) as go:
        order, fds = recv(go, max_fds=3)
    if order is None:
        return None
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    _die_with(int(order["client"]))
    return order


def _die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` ends (at once if it already has)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def wait() -> None:
        import select

        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="unbroken-die-with-worker", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
