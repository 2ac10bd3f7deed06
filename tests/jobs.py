"""The tests' one way to launch a job of several ranks and kill it where they want (docs/testing.md).

- :func:`torchrun` — the command of a ``torchrun --standalone`` job (``python -m torch.distributed.run``,
  the interpreter of the tests) of ``n`` ranks;
- :func:`run` — run a command to its end, streaming its output lines to ``on_line(line, proc)``; bounded:
  after ``timeout`` its process group is killed, and so are the ranks whose pids the job wrote into
  ``workers`` (``pid-r<rank>`` files: torchrun's workers have sessions of their own and outlive their
  agent); the same ranks are killed when the call ends for any reason, so no test leaves a job behind;
- :func:`kill_at` — an ``on_line`` that SIGKILLs one rank when it prints a given step.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

OnLine = Callable[[str, subprocess.Popen], None]


def torchrun(n: int, script: str | os.PathLike[str], *args: str, restarts: int = 0) -> list[str]:
    """The command of a ``torchrun --standalone`` job of ``n`` ranks running ``script`` with ``args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            f"--max-restarts={restarts}", str(script), *args]


def _started_at(pid: int) -> float:
    """When process ``pid`` started (seconds since the epoch), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def kill_ranks(workers: Path | None) -> None:
    """SIGKILL every rank whose pid is in ``workers/pid-r*`` and still alive. A pid is killed only if
    its process started before the file was written (a rank writes its own pid once started): the
    machine reuses pids (``pid_max`` is often 32768), and an earlier attempt's file may name a process
    of another test by now."""
    if workers is None:
        return
    for f in workers.glob("pid-r*"):
        with contextlib.suppress(OSError, ValueError, StopIteration, IndexError):
            pid = int(f.read_text())
            if _started_at(pid) <= f.stat().st_mtime + 0.05:  # (the start time is counted in clock ticks)
                os.kill(pid, signal.SIGKILL)


def run(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 300,
        on_line: OnLine | None = None, workers: Path | None = None,
        on_timeout: Callable[[], Any] | None = None) -> tuple[int, str]:
    """Run ``cmd`` to its end (its output closes), streaming each line to ``on_line(line, proc)``;
    ``(exit code, output)``. See the module docstring for the bounds and the clean-up."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env if env is not None else dict(os.environ, PYTHONUNBUFFERED="1"),
                            start_new_session=True)
    lines: list[str] = []

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        kill_ranks(workers)
        if on_timeout is not None:
            on_timeout()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if on_line is not None:
                on_line(line, proc)
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # a failed check above: never leave a job behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_ranks(workers)
    return proc.returncode, "".join(lines)


def kill_at(base: Path, rank: int, line: int) -> tuple[OnLine, list[int]]:
    """An ``on_line`` that SIGKILLs rank ``rank`` (its pid in ``base/out/pid-r<rank>``) once it prints
    ``rank <rank> step <line>`` (the ranks' lines may run together); and the list of pids killed."""
    killed: list[int] = []

    def on_line(text: str, proc: subprocess.Popen) -> None:
        if not killed and re.search(rf"rank {rank} step {line}(?!\d)", text):
            pid = int((base / "out" / f"pid-r{rank}").read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return on_line, killed
