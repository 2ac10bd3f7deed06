"""A process failing with an uncaught exception after a watched signal arrived ends as it would
have without unbroken, once its Checkpointer is closed (unbroken.faults.signals, "A process that
ends with an uncaught exception stops watching"): the torchrun survivor whose peer died and whose
agent sent SIGTERM no longer goes through the interpreter's whole finalization first.

Real child processes; what is checked is how they ended, what ran before (the Checkpointer's exit
hook: its lock released, its save committed) and what did not (an ``atexit`` handler registered
before unbroken, which runs after unbroken's, as the interpreter's finalization does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unbroken

CHILD = textwrap.dedent("""
    import atexit, os, signal, sys
    atexit.register(lambda: open(sys.argv[2], "w").write("finalized"))  # runs after unbroken's exit work
    import torch, unbroken
    ckpt = unbroken.Checkpointer(sys.argv[1], save_every=1)
    state = {"model": torch.nn.Linear(2, 2)}
    ckpt.restore(state)
    ckpt.step(state)  # step 1, saved
    if sys.argv[3] != "none":
        os.kill(os.getpid(), getattr(signal, sys.argv[3]))  # torchrun's agent tearing the group down
    if sys.argv[4] == "raise":
        raise RuntimeError("a peer died in the collective")  # before the next step boundary
    ckpt.step(state)  # the step boundary: a flagged signal is served there (save, exit 75)
    ckpt.close()
""")


def child(tmp_path: Path, sig: str, how: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    marker = tmp_path / "finalized"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run"), str(marker), sig, how],
                       capture_output=True, text=True, timeout=300, env=env, start_new_session=True)
    return p, marker


def resumes_at(tmp_path: Path, step: int) -> None:
    import torch

    with unbroken.Checkpointer(tmp_path / "run") as ckpt:  # the lock was released by the exit hook
        ckpt.restore({"model": torch.nn.Linear(2, 2)})
        assert ckpt.progress.step == step


@pytest.mark.parametrize("sig", ["SIGTERM"])
def test_a_signal_then_an_uncaught_exception_ends_by_the_signal_after_closing(tmp_path: Path, sig: str) -> None:
    p, marker = child(tmp_path, sig, "raise")
    assert p.returncode == -getattr(signal, sig), (p.returncode, p.stderr[-3000:])  # as without unbroken
    assert "a peer died" in p.stderr  # the exception was reported first
    assert not marker.exists(), "the interpreter's finalization ran: the signal was held back"
    resumes_at(tmp_path, 1)


def test_an_uncaught_exception_without_a_signal_exits_as_python_does(tmp_path: Path) -> None:
    p, marker = child(tmp_path, "none", "raise")
    assert p.returncode == 1, p.stderr[-3000:]
    assert marker.exists()
    resumes_at(tmp_path, 1)


def test_a_signal_served_at_the_step_boundary_still_exits_75(tmp_path: Path) -> None:
    p, marker = child(tmp_path, "SIGTERM", "step")
    assert p.returncode == 75, p.stderr[-3000:]  # the preemption exit, unchanged
    assert marker.exists()
    resumes_at(tmp_path, 2)
