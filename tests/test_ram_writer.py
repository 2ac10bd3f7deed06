"""The RAM tier's writer process under faults of its own (issue 33 §2): killed while idle, stopped
(SIGSTOP: a hung filesystem looks the same), and a SIGTERM to the trainer's whole process group. Every
wait on it is bounded, its answers are matched to the process and checkpoint they come from, and it
runs in its own session: a group preemption exits 75 whatever state the writer is in.

Each case would hang (or die) on the code before the fix; :func:`hang_guard` turns a hang into a failure.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.demo import compare, run_attempt
from unbroken.faults import EXIT_PREEMPTED

from hang import hang_guard

STEPS, HIDDEN = 24, 64


def _state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.nn.Linear(8, 8, bias=False)}


def _gone(pid: int, timeout: float = 30.0) -> None:
    """Wait until ``pid`` is dead (a zombie counts: its output is closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still alive after {timeout} s")


def on_disk(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.is_dir() and p.name.startswith("step-"))


def test_a_writer_killed_while_idle_is_replaced_and_the_next_copy_commits(tmp_path: Path) -> None:
    """Before the fix the dead writer's end of output was taken for its successor's answer, and the
    trainer then waited forever on the successor."""
    tier = unbroken.RamTier(keep_last=2, persist_every=2, root=str(tmp_path / "shm"))
    state = _state()
    with hang_guard(120, "a wait on the writer process"), \
            unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=tier) as ckpt:
        ckpt.restore(state)
        for _ in range(2):
            ckpt.step(state)
        assert ckpt.wait(60)
        first = ckpt.run.ram.persister.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _gone(first)
        time.sleep(0.2)  # its end of output reaches the trainer's reader thread
        for _ in range(2):
            ckpt.step(state)
        assert ckpt.wait(60)  # step 4, copied by a new writer
        assert ckpt.run.ram.persister.pid not in (None, first)
        assert not ckpt.run.ram.failures, ckpt.run.ram.failures
    assert on_disk(tmp_path / "run")[-1] == "step-000000004"


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_stopped_writer_is_replaced_and_close_is_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP of the writer in the middle of its work: the next due copy after ``close_timeout_s``
    kills it with a warning and goes to a new writer; ``close()`` with a writer stopped again ends
    within its bound, kills it, and keeps the RAM folder (the next start restores from it)."""
    caplog.set_level(logging.WARNING, logger="unbroken")
    tier = unbroken.RamTier(keep_last=2, persist_every=2, root=str(tmp_path / "shm"), close_timeout_s=2.0)
    state = _state()
    stopped: list[int] = []
    try:
        with hang_guard(120, "a wait on the writer process"):
            ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=tier)
            ckpt.restore(state)
            for _ in range(2):
                ckpt.step(state)
            assert ckpt.wait(60)
            pid = ckpt.run.ram.persister.pid
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            for _ in range(2):
                ckpt.step(state)  # step 4 handed to the stopped writer: never answered
            time.sleep(2.5)
            for _ in range(2):
                ckpt.step(state)  # step 6 due: the stopped writer is killed, a new one copies 6
            assert "has not finished copying step-000000004" in caplog.text
            assert ckpt.wait(60)
            assert on_disk(tmp_path / "run")[-1] == "step-000000006"
            again = ckpt.run.ram.persister.pid
            assert again not in (None, pid)
            os.kill(again, signal.SIGSTOP)
            stopped.append(again)
            for _ in range(2):
                ckpt.step(state)  # step 8 handed to the stopped writer
            ckpt.close()
        assert "did not finish within 2 s" in caplog.text
        assert list((tmp_path / "shm").rglob("manifest.json")), "the RAM folder is kept for the next start"
        for p in stopped:
            _gone(p)  # killed, not left stopped
    finally:
        for p in stopped:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.e2e
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigterm_to_the_whole_process_group_exits_75_and_resumes_bitwise(tmp_path: Path) -> None:
    """A scheduler's SIGTERM to the trainer's process group. Before the fix it killed the writer too
    (same group), whose death was then waited on forever: the job never exited 75."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", UNBROKEN_RAM_ROOT=str(tmp_path / "shm"))

    def cmd(base: Path) -> list[str]:
        return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out",
                str(base / "out"), "--steps", str(STEPS), "--save-every", "1", "--hidden", str(HIDDEN), "--seed", "3",
                "--ram", "3"]

    ref = run_attempt(cmd(tmp_path / "ref"), "none", "", env)
    assert ref.ended == "finished", ref
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(cmd(tmp_path), stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                start_new_session=True)
    assert proc.stdout is not None
    sent = False
    try:
        with hang_guard(180, "the preempted trainer"):  # the bug was waiting forever
            for line in proc.stdout:
                if not sent and line.startswith("step ") and int(line.split()[1]) >= 10:
                    os.killpg(proc.pid, signal.SIGTERM)
                    sent = True
            rc = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert sent and rc == EXIT_PREEMPTED, (rc, err.read_text()[-3000:])
    done = run_attempt(cmd(tmp_path), "none", "", env)
    assert done.ended == "finished" and done.started.startswith("resumed from step"), done
    verdict = compare(tmp_path / "ref" / "out", tmp_path / "out")
    assert all(verdict.values()), verdict


DROPPED = """
import gc, sys
import torch
import unbroken

def main():
    torch.manual_seed(0)
    state = {"w": torch.nn.Linear(8, 8, bias=False)}
    tier = unbroken.RamTier(keep_last=2, persist_every=100, root=sys.argv[2])
    ckpt = unbroken.Checkpointer(sys.argv[1], save_every=1, ram=tier)  # a local, never closed
    ckpt.restore(state)
    for _ in range(5):
        ckpt.step(state)

main()
gc.collect()  # the Checkpointer is out of scope
print("main returned", flush=True)
"""


@pytest.mark.e2e
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_checkpointer_dropped_without_close_persists_its_newest_ram_checkpoint_at_exit(tmp_path: Path) -> None:
    """Before the fix the dropped Checkpointer was collected with its RAM tier and nothing reached the
    disk (``persist_every=100``: only a close persists here)."""
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(tmp_path / "shm")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "main returned" in r.stdout, r.stderr[-3000:]
    assert on_disk(tmp_path / "run") == ["step-000000005"], r.stderr[-3000:]
    unbroken.verify(str(tmp_path / "run" / "step-000000005"))
