"""SIGTERM to the whole process group, with DataLoader worker processes (what SLURM and most
launchers do): during a step, in the middle of a save, and while the workers start. Every
time: one complete checkpoint of a step boundary, the preemption exit code (75), and a
resumed run bitwise equal to the uninterrupted one.

The training job is unbroken.demo.train with ``--workers 2``, started in its own session so
``killpg`` reaches the main process and its workers, as a scheduler's signal would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from unbroken.demo import compare, run_attempt
from unbroken.faults import EXIT_PREEMPTED
from unbroken.store import open_store

pytestmark = pytest.mark.e2e
STEPS, SAVE_EVERY, HIDDEN = 30, 5, 128
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cmd(base: Path) -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out", str(base / "out"),
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--hidden", str(HIDDEN), "--seed", "4",
            "--workers", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    assert run_attempt(cmd(base), "none", "", ENV).ended == "finished"
    return base / "out"


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def sigterm_group(base: Path, when: str, env: dict | None = None) -> tuple[int, str]:
    """Run once and SIGTERM the whole process group at ``when``; (exit code, output)."""
    proc = subprocess.Popen(cmd(base), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or ENV, start_new_session=True)
    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(300, kill)  # a test that went wrong must not hang the suite
    watchdog.start()
    try:
        return _drive(proc, when)
    finally:
        watchdog.cancel()


def _drive(proc: subprocess.Popen, when: str) -> tuple[int, str]:
    out, sent = [], False
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if sent:
            continue
        if when == "startup" and line.startswith(("fresh start", "resumed")):
            os.killpg(proc.pid, signal.SIGTERM)  # the loader's workers are being started right now
            sent = True
        elif when == "step" and line.strip() == "step 8":
            os.killpg(proc.pid, signal.SIGTERM)
            sent = True
        elif when == "save" and line.strip() == f"step {2 * SAVE_EVERY}":  # this step's save freezes
            deadline = time.monotonic() + 60
            while not _stopped(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _stopped(proc.pid), "the save did not reach its fault point"
            os.killpg(proc.pid, signal.SIGTERM)  # workers and the frozen main process
            time.sleep(0.5)  # the workers get it now, the main process when it runs again
            os.kill(proc.pid, signal.SIGCONT)
            sent = True
    return proc.wait(timeout=120), "".join(out)


@pytest.mark.parametrize("when", [pytest.param("step", marks=pytest.mark.slow),  # the first two run long: the
                                  pytest.param("save", marks=pytest.mark.slow),  # whole suite, not the fast tier
                                  "startup"])
def test_sigterm_to_the_process_group_with_workers(reference: Path, tmp_path: Path, when: str) -> None:
    # frozen in the second save (step 10) after its data files, before its manifest
    env = dict(ENV, UNBROKEN_FAULT_ACTION="stop", UNBROKEN_FAULTS="save.before_manifest=2") if when == "save" else None
    code, out = sigterm_group(tmp_path, when, env)
    assert code == EXIT_PREEMPTED, out
    preempted = [int(x.split()[-1]) for x in out.splitlines() if x.startswith("preempted at step")]
    assert len(preempted) == 1, out
    step = preempted[0]
    store = open_store(tmp_path / "run")
    assert f"step-{step:09d}" in store.list_committed() or (step == 0 and when == "startup"), out
    att = run_attempt(cmd(tmp_path), "none", "", ENV)
    assert att.ended == "finished", att
    assert att.started == (f"resumed from step {step}" if step else "fresh start"), att
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results
