"""Repeated signals through real processes: one preemption delivered twice is one request; Ctrl-C
pressed again seconds later aborts at once, even in the middle of the preemption save.

The job is unbroken.demo.train. Ctrl-C is typed into a real terminal (a pseudo-terminal whose
line discipline sends SIGINT to the foreground process group), and the long save is a real save
frozen at a fault point (``UNBROKEN_FAULT_ACTION=stop``), so no timing decides the outcome.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from unbroken.demo import compare, run_attempt
from unbroken.faults import EXIT_PREEMPTED
from unbroken.faults.signals import SAME_REQUEST_S
from unbroken.store import open_store

pytestmark = pytest.mark.e2e
STEPS, SAVE_EVERY, HIDDEN = 30, 10, 128
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cmd(base: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out", str(base / "out"),
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--hidden", str(HIDDEN), "--seed", "3", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    assert run_attempt(cmd(base), "none", "", ENV).ended == "finished"
    return base / "out"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _wait_for(what: str, check, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


class Terminal:
    """A process on a pseudo-terminal of its own: its output, and keys typed into it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a new session whose controlling terminal is the pty
            try:  # what a shell gives a foreground job: default dispositions, nothing blocked (an in-process
                # test of the same pytest worker may have left SIGINT ignored: Lightning does on Ctrl-C)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, set())
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.out = ""
        self.status: int | None = None
        self._watchdog = threading.Timer(600, self.kill)  # a test gone wrong must not hang the suite
        self._watchdog.start()

    def read(self, until: str | None = None, timeout: float = 300) -> None:
        """Read the output until ``until`` appears in it (or the end, for None)."""
        deadline = time.monotonic() + timeout
        while until is None or until not in self.out:
            assert time.monotonic() < deadline, f"{until!r} never came:\n{self.out[-3000:]}"
            if not select.select([self.fd], [], [], 0.2)[0]:
                continue
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the child is gone
                chunk = b""
            if not chunk:
                assert until is None, f"ended before {until!r}:\n{self.out[-3000:]}"
                return
            self.out += chunk.decode(errors="replace").replace("\r\n", "\n")

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self) -> int:
        """The wait status of the child (os.waitstatus_to_exitcode: -2 for death by SIGINT)."""
        self.read(None)
        _, status = os.waitpid(self.pid, 0)
        self._watchdog.cancel()
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def test_ctrl_c_pressed_again_seconds_later_aborts_at_once_during_the_preemption_save(reference: Path,
                                                                                     tmp_path: Path) -> None:
    """The first Ctrl-C asks for a preemption save; the save is long (frozen at a fault point); Ctrl-C
    pressed again more than SAME_REQUEST_S later ends the process at once, by SIGINT: no checkpoint, no
    emergency save. (Before: the second Ctrl-C raised KeyboardInterrupt inside the save, the step guard
    caught it and wrote an emergency checkpoint, and the run exited 75, 3 of 3 tries.) Nothing is lost
    that a SIGKILL would not lose: the next attempt resumes from the last committed checkpoint, bitwise."""
    env = dict(ENV, UNBROKEN_FAULT_ACTION="stop", UNBROKEN_FAULTS="save.before_manifest=2")  # the 2nd save freezes
    term = Terminal(cmd(tmp_path), env)
    term.read(until="step 13\n")
    term.type(b"\x03")  # Ctrl-C
    _wait_for("the preemption save freezes", lambda: _state(term.pid) == "T")
    time.sleep(SAME_REQUEST_S + 0.5)  # a deliberate repeat: seconds after the first was handled
    term.type(b"\x03")  # Ctrl-C again, while the save is still running
    os.kill(term.pid, signal.SIGCONT)
    code = term.wait()
    assert code == -signal.SIGINT, term.out
    assert "preempted at step" not in term.out and "emergency checkpoint" not in term.out, term.out
    assert open_store(tmp_path / "run").list_committed() == [f"step-{SAVE_EVERY:09d}"], term.out
    att = run_attempt(cmd(tmp_path), "none", "", ENV)
    assert att.started == f"resumed from step {SAVE_EVERY}", att
    assert all(compare(reference, tmp_path / "out").values())


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for ``sig`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise AssertionError("no SigCgt")


@pytest.mark.parametrize("target", [5, 14, 23])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_same_sigterm_twice_within_milliseconds_is_one_preemption(reference: Path, tmp_path: Path,
                                                                      target: int) -> None:
    """SIGTERM, then 20 ms after the process handled it the same SIGTERM again (what a scheduler that
    signals every process plus torchrun's forwarding deliver): one preemption, saved at the step
    boundary, exit 75, no step lost. (Before: the second one was taken as "abort now": no save, died of
    SIGTERM, up to the whole save interval lost.) The process has DataLoader workers, so the moment its
    handler ran is visible: it quiets PyTorch's SIGCHLD handler then (not a timing guess)."""
    env = dict(ENV, UNBROKEN_FAULT_DELAY="0.2")  # a slow store: the save takes a while
    proc = subprocess.Popen(cmd(tmp_path, "--workers", "2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.strip() == f"step {target}":
                break
        assert _catches(proc.pid, signal.SIGCHLD), "".join(out)  # the DataLoader's handler
        proc.send_signal(signal.SIGTERM)
        _wait_for("the handler ran", lambda: not _catches(proc.pid, signal.SIGCHLD))
        time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out += proc.stdout.readlines()
        code = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(out)
    assert code == EXIT_PREEMPTED, text
    steps = [int(m) for m in re.findall(r"^step (\d+)$", text, re.M)]
    preempted = [int(m) for m in re.findall(r"^preempted at step (\d+)$", text, re.M)]
    assert preempted == [steps[-1]] and steps[-1] >= target, text  # no completed step lost
    assert f"step-{steps[-1]:09d}" in open_store(tmp_path / "run").list_committed()
    att = run_attempt(cmd(tmp_path, "--workers", "2"), "none", "", ENV)
    assert att.started == f"resumed from step {steps[-1]}", att
    assert all(compare(reference, tmp_path / "out").values())
