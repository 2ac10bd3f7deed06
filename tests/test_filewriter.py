"""The writer process of background saves (:mod:`unbroken.checkpoint.background.filewriter`) and its shared-memory
staging
(:mod:`unbroken.checkpoint.background.shm`): the files it writes are the bytes the training process would write; its
errors fail the save like any write error (raised in the loop, nothing committed); a writer killed
during a save is replaced and the save still commits; it dies with a SIGKILLed trainer and leaves
nothing the next start does not clean; it ends at ``close()``."""

from __future__ import annotations

import errno
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import unbroken
from unbroken.checkpoint.background.filewriter import FileWriter
from unbroken.checkpoint.background.shm import SharedArena
from unbroken.checkpoint.snapshot import Snapshotter


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}


def one_step(state: dict[str, Any]) -> None:
    state["model"](torch.randn(16, 64)).pow(2).mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def writers(parent: int | None = None) -> list[int]:
    """The pids of the writer processes whose parent is ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"unbroken.checkpoint.background.filewriter" in cmd and ppid == parent:
            out.append(int(d.name))
    return out


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))


def tensor_files(ckpt: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir()) if p.suffix == ".safetensors"}


@pytest.mark.parametrize("mode", [True, "lazy"], ids=["copy", "lazy"])
def test_the_writer_process_writes_the_bytes_the_training_process_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: Any) -> None:
    jobs: list[list[str]] = []
    real = FileWriter.write

    def spy(self: FileWriter, staging: Any, files: Any, *a: Any, **k: Any) -> Any:
        jobs.append(sorted(files))
        return real(self, staging, files, *a, **k)

    monkeypatch.setattr(FileWriter, "write", spy)
    for run, process in ((tmp_path / "process", "1"), (tmp_path / "thread", "0")):
        monkeypatch.setenv("UNBROKEN_WRITER_PROCESS", process)
        state = build()
        with unbroken.Checkpointer(run, save_every=2, keep_last=None, preemption=None, async_save=mode) as ckpt:
            ckpt.restore(state)
            for _ in range(6):
                one_step(state)
                ckpt.step(state)
                assert len(writers()) == (1 if process == "1" else 0)  # started with the run
        assert writers() == []  # close() ended it
    # every tensor file of both ranks' parts went through the writer process, three saves
    assert len(jobs) == 6 and all(j for j in jobs)
    assert checkpoints(tmp_path / "process") == checkpoints(tmp_path / "thread") == [
        "step-000000002", "step-000000004", "step-000000006"]
    for name in checkpoints(tmp_path / "process"):
        a, b = tensor_files(tmp_path / "process" / name), tensor_files(tmp_path / "thread" / name)
        assert a.keys() == b.keys() and len(a) >= 3 and all(a[f] == b[f] for f in a), name
        unbroken.verify(tmp_path / "process" / name)


def test_an_error_in_the_writer_process_fails_the_save_and_loses_nothing(tmp_path: Path) -> None:
    """A real error of the writer's writes (a file size limit: EFBIG) is raised in the loop by a
    later step, as any failed background save is; nothing of it is committed or left behind."""
    run, state = tmp_path / "run", build()
    ckpt = unbroken.Checkpointer(run, save_every=2, keep_last=None, preemption=None, async_save=True)
    ckpt.restore(state)
    for _ in range(2):
        one_step(state)
        ckpt.step(state)
    assert ckpt.flush().step == 2
    [pid] = writers()
    limits = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, limits[1]))  # the writer's files may not grow past 4 KB
    with pytest.raises(unbroken.StorageError, match="File too large") as raised:
        for _ in range(10):
            time.sleep(0.05)
            one_step(state)
            ckpt.step(state)
    assert raised.value.errno == errno.EFBIG and ckpt.progress.step <= 6
    assert checkpoints(run) == ["step-000000002"] and not list(run.glob(".staging-*"))
    resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)
    ckpt.save(state)
    ckpt.close()  # the next save (same writer) commits
    assert checkpoints(run)[-1] == f"step-{ckpt.progress.step:09d}" and len(checkpoints(run)) == 2
    unbroken.verify(run / checkpoints(run)[-1])


def test_a_writer_killed_during_a_save_is_replaced_and_the_save_still_commits(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run, state = tmp_path / "run", build()
    with unbroken.Checkpointer(run, save_every=1, keep_last=None, preemption=None, async_save=True) as ckpt:
        ckpt.restore(state)
        one_step(state)
        ckpt.step(state)
        assert ckpt.flush().step == 1
        [first] = writers()
        os.kill(first, signal.SIGSTOP)  # the next job waits in its socket...
        one_step(state)
        want = {k: v.clone() for k, v in state["model"].state_dict().items()}
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            ckpt.step(state)  # step 2's save goes to the stopped writer
            deadline = time.monotonic() + 30
            while not list(run.glob(".staging-*")) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            os.kill(first, signal.SIGKILL)  # ...and the writer dies with it in hand
            one_step(state)  # training went on meanwhile; the checkpoint keeps step 2's values
            info = ckpt.flush()
        assert info is not None and info.step == 2
        assert "writing the save in this process instead" in caplog.text
        have = build()
        unbroken.load(run / "step-000000002", have, strict=False)
        assert all(torch.equal(have["model"].state_dict()[k], want[k]) for k in want)
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            ckpt.step(state)  # a new writer for step 3's save
            assert ckpt.flush().step == 3
        [second] = writers()
        assert second != first
    assert checkpoints(run) == ["step-000000001", "step-000000002", "step-000000003"]
    for name in checkpoints(run):
        unbroken.verify(run / name)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_writer_dies_with_a_killed_trainer_and_the_next_start_cleans_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, torch, unbroken
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_filewriter import build, one_step, writers
        state = build()
        ckpt = unbroken.Checkpointer({str(run)!r}, save_every=1, keep_last=2, preemption=None, async_save=True)
        ckpt.restore(state)
        while True:
            one_step(state)
            ckpt.step(state)
            if ckpt.progress.step == 3:
                print("writer", writers()[0], flush=True)
    """))
    env = dict(os.environ, PYTHONUNBUFFERED="1", UNBROKEN_FAULT_DELAY="0.05")  # saves are in flight most of the time
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("writer "), line
        pid = int(line.split()[1])
        time.sleep(0.3)
        proc.kill()
        proc.wait(timeout=30)
        assert gone(pid), "the writer process outlived the SIGKILLed trainer"
    finally:
        proc.kill()
    state = build()
    with unbroken.Checkpointer(run, preemption=None) as ckpt:
        info = ckpt.restore(state)
        assert info is not None and info.step >= 2
    assert not list(run.glob(".staging-*"))


def test_close_ends_the_writer_though_a_forked_worker_holds_its_socket(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A DataLoader worker forked after the writer started holds the trainer's end of the socket
    too: close() tells the writer to end instead of waiting for the socket to close."""
    state = build()
    ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=1, preemption=None, async_save=True)
    ckpt.restore(state)
    one_step(state)
    ckpt.step(state)
    [pid] = writers()
    worker = os.fork()
    if worker == 0:  # the forked worker: holds every descriptor of the trainer, does nothing
        time.sleep(60)
        os._exit(0)
    try:
        with caplog.at_level(logging.WARNING, logger="unbroken"):
            ckpt.close()
        assert gone(pid, within=0.0) and "did not end" not in caplog.text
    finally:
        os.kill(worker, signal.SIGKILL)
        os.waitpid(worker, 0)
    unbroken.verify(tmp_path / "run" / "step-000000001")


def test_shared_arena_buffers_are_aligned_located_and_started_over_when_mostly_abandoned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import unbroken.checkpoint.background.shm as shm

    monkeypatch.setattr(shm, "MIN_SEGMENT", 1 << 20)
    arena = SharedArena()
    a = arena.empty((1000,), torch.float32)
    b = arena.empty((3,), torch.int8)
    c = arena.empty((300_000,), torch.float64)  # 2.4 MB: a second segment
    assert len(arena.segments) == 2 and arena.empty((0, 4), torch.float32).numel() == 0
    where = [arena.locate(t) for t in (a, b, c)]
    assert all(w is not None and w[1] % shm.ALIGN == 0 for w in where)
    assert where[0][0] == where[1][0] != where[2][0]
    assert arena.locate(torch.zeros(4)) is None
    a.fill_(1.5)
    assert torch.equal(a, torch.full((1000,), 1.5))
    # a Snapshotter whose state changed shape keeps allocating: once over half is abandoned, it starts over
    snap = Snapshotter(copy=True, arena=arena)
    for n in (10, 20, 40, 80, 160, 320):
        captured = snap.capture({"w": torch.arange(float(n * 10_000))})
        [entry] = captured.files["t00-w.safetensors"]
        assert torch.equal(entry.tensor, torch.arange(float(n * 10_000))) and arena.locate(entry.tensor)
    assert arena.size <= 4 * 320 * 10_000 * 8 + (1 << 20)
    assert arena.dropped  # the segments given up, for the writer process to unmap
    with pytest.raises(ValueError):
        Snapshotter(copy=False, arena=arena)
