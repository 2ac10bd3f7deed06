"""The spare forker (``unbroken.launch.forker``): spares forked from one interpreter, their ends reported.

Against a real forker process (importing numpy only, to be quick; the spare server's forker imports torch:
``tests/test_warm_restart_torchrun.py``): a forked spare runs its launch and its exit status (a code, a signal)
comes back; its parent is the forker; two spares draw different random numbers (reseeded after the fork, as two
new interpreters would); a forker that cannot import answers each spare with the failure; a forker SIGKILLed
leaves its running training alone, whose end is then reported as unknown (``LOST``), and forks no more.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from procs import alive

from unbroken.launch import wire
from unbroken.launch.forks import LOST, Forked, Forker
from unbroken.launch.spare import read_answer

pytestmark = pytest.mark.e2e

SCRIPT = """
import os, random, signal, sys, time
import numpy
how = sys.argv[1]
print(os.getpid(), os.getppid(), numpy.random.randint(1 << 30), random.getrandbits(30), flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
while how == "wait" and not os.path.exists("go-on"):
    time.sleep(0.02)
sys.exit(7)
"""


class Spare:
    def __init__(self, forker: Forker) -> None:
        self.go, go_child = socket.socketpair()
        self.ready, ready_w = os.pipe()
        proc = forker.fork(go_child.fileno(), ready_w)
        go_child.close()
        os.close(ready_w)
        assert proc is not None
        self.proc: Forked = proc

    def launch(self, tmp: Path, how: str) -> Path:
        out = tmp / f"out-{how}-{time.monotonic_ns()}"
        assert read_answer(self.ready, 60) == "ready"
        with open(os.devnull, "rb") as stdin, open(out, "wb") as stdout:
            wire.send(self.go, {"argv": ["job.py", how], "script": "job.py", "module": None, "cwd": str(tmp),
                                "env": dict(os.environ), "client": os.getpid()},
                      [stdin.fileno(), stdout.fileno(), stdout.fileno()])
        self.go.close()
        return out


def first_line(path: Path, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.endswith("\n"):
            return [int(x) for x in text.split()]
        time.sleep(0.02)
    raise AssertionError(f"nothing printed to {path}")


@pytest.fixture
def forker(tmp_path: Path):  # type: ignore[no-untyped-def]
    (tmp_path / "job.py").write_text(SCRIPT)
    started = Forker([], ("numpy",))
    yield started
    started.close()


def test_forked_spares_run_their_launch_and_their_ends_are_reported(tmp_path: Path, forker: Forker) -> None:
    spares = [Spare(forker) for _ in range(3)]
    outs = [spares[0].launch(tmp_path, "exit"), spares[1].launch(tmp_path, "kill")]
    assert spares[0].proc.wait(60) == 7
    assert spares[1].proc.wait(60) == -signal.SIGKILL
    (pid0, parent0, np0, py0), (pid1, parent1, np1, py1) = (first_line(out) for out in outs)
    assert parent0 == parent1 == forker.proc.pid
    assert (pid0, pid1) == (spares[0].proc.pid, spares[1].proc.pid)
    assert np0 != np1 and py0 != py1  # reseeded: not the forker's one state twice
    spares[2].go.close()  # not needed: it exits 0 when its GO closes
    assert spares[2].proc.wait(60) == 0
    assert forker.up and forker.proc.poll() is None


def test_a_forker_that_cannot_import_answers_every_spare_with_its_failure(tmp_path: Path) -> None:
    broken = Forker([], ("numpy", "no_such_module_here"))
    try:
        spare = Spare(broken)
        answer = read_answer(spare.ready, 60)
        assert answer is not None and answer.startswith("failed ModuleNotFoundError"), answer
        assert spare.proc.wait(60) == 3
    finally:
        broken.close()


def test_a_killed_forker_leaves_its_training_running_and_its_end_is_unknown(tmp_path: Path, forker: Forker) -> None:
    spare = Spare(forker)
    pid, parent, _, _ = first_line(spare.launch(tmp_path, "wait"))
    assert parent == forker.proc.pid
    os.kill(forker.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while forker.up and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not forker.up
    assert alive(pid) and spare.proc.poll() is None  # the training goes on
    r, w = os.pipe()
    assert forker.fork(r, w) is None  # no more forks
    os.close(r)
    os.close(w)
    (tmp_path / "go-on").touch()
    assert spare.proc.wait(60) == LOST  # its end is seen (its pidfd); its status went with the forker
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
