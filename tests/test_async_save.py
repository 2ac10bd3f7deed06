"""Background saves (``Checkpointer(..., async_save=True)``): the loop goes on while a save is
written, yet every checkpoint holds exactly the state of its step; at most one save is in
flight; a background failure is raised in the loop, never lost; the process does not end
before the last save committed; a SIGKILL while a background write is in flight, and an
exception raised while one is in flight, resume bitwise."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken.checkpoint import persist
from unbroken.checkpoint.background.filewriter import FileWriter
from unbroken.demo import compare, run_attempt

STEPS, SAVE_EVERY = 12, 3
MODES = [pytest.param(True, id="copy"), pytest.param("lazy", id="lazy")]
SLOW = dict(os.environ, PYTHONUNBUFFERED="1", UNBROKEN_FAULT_DELAY="0.3")  # each save point sleeps 0.3 s


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 4))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}


def one_step(state: dict[str, Any]) -> None:
    loss = state["model"](torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optimizer"].state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": v.clone() for k, v in s.items()})
    return out


def saved_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    state = build()
    unbroken.load(ckpt, state, strict=False)  # a Checkpointer adds its reserved key
    return snapshot(state)


@pytest.fixture()
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every tensor file takes 0.2 s longer to write, so training certainly runs on (and changes
    the live tensors) while a background save is being written. Records the writing thread."""
    real, threads = persist.write_tensors, []
    real_process = FileWriter.write

    def slow(staging, fname, entries):
        threads.append(threading.current_thread().name)
        time.sleep(0.2)
        return real(staging, fname, entries)

    def slow_process(self, staging, files, *args, **kwargs):  # the writer process's job, sent from this thread
        threads.append(threading.current_thread().name)
        time.sleep(0.2 * len(files))
        return real_process(self, staging, files, *args, **kwargs)

    monkeypatch.setattr(persist, "write_tensors", slow)
    monkeypatch.setattr(FileWriter, "write", slow_process)
    return threads


@pytest.mark.parametrize("mode", MODES)
def test_each_background_checkpoint_holds_exactly_its_steps_state(
        tmp_path: Path, slow_writes: list[str], mode: Any) -> None:
    state = build()
    expected = {}
    with unbroken.Checkpointer(tmp_path / "run", save_every=SAVE_EVERY, keep_last=None, preemption=None,
                               async_save=mode) as ckpt:
        ckpt.restore(state)
        for _ in range(STEPS):
            one_step(state)
            assert ckpt.step(state) is None  # a background save returns at once
            if ckpt.progress.step % SAVE_EVERY == 0:
                expected[ckpt.progress.step] = snapshot(state)
    assert slow_writes and all(name.startswith("unbroken-save") for name in slow_writes)
    got = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-"))
    assert got == [f"step-{s:09d}" for s in sorted(expected)]
    for step, want in expected.items():
        have = saved_tensors(tmp_path / "run" / f"step-{step:09d}")
        assert have.keys() == want.keys() and all(torch.equal(have[k], want[k]) for k in want), step


@pytest.mark.parametrize("mode", MODES)
def test_flush_returns_the_commit_and_one_save_at_most_is_in_flight(
        tmp_path: Path, slow_writes: list[str], mode: Any) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", keep_last=None, preemption=None, async_save=mode) as ckpt:
        ckpt.restore(state)
        one_step(state)
        ckpt.progress.step = 1
        assert ckpt.save(state) is None and ckpt.last_saved is None
        one_step(state)
        ckpt.progress.step = 2
        assert ckpt.save(state) is None  # waited for step 1 to commit before copying step 2
        assert ckpt.last_saved is not None and ckpt.last_saved.step == 1
        info = ckpt.flush()
        assert info is not None and info.step == 2 and ckpt.last_saved == info
        assert ckpt.flush() is None
    assert [c.step for c in unbroken.Checkpointer(tmp_path / "run", preemption=None).checkpoints()] == [2, 1]


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_background_save_is_raised_in_the_loop_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: Any) -> None:
    # the background machinery's error path, written by this process (the writer process's own errors:
    # tests/test_filewriter.py)
    monkeypatch.setenv("UNBROKEN_WRITER_PROCESS", "0")
    state = build()
    ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=2, keep_last=None, preemption=None, async_save=mode)
    ckpt.restore(state)
    real = persist.write_tensors
    for _ in range(2):
        one_step(state)
        ckpt.step(state)
    assert ckpt.flush().step == 2

    def full_disk(staging, fname, entries):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(persist, "write_tensors", full_disk)
    with pytest.raises(unbroken.StorageError, match="No space left"):
        for _ in range(10):  # step 4's save fails in the background; a later step raises it
            time.sleep(0.05)
            one_step(state)
            ckpt.step(state)
    assert ckpt.progress.step <= 6  # raised by step 5 or 6 (whichever found it finished), never later
    monkeypatch.setattr(persist, "write_tensors", real)
    ckpt.close()
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-000000002"]
    assert not [p for p in run.iterdir() if p.name.startswith(".staging-")]
    unbroken.verify(run / "step-000000002")


@pytest.mark.parametrize("mode", MODES)
def test_close_raises_a_failure_it_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: Any) -> None:
    monkeypatch.setenv("UNBROKEN_WRITER_PROCESS", "0")  # an error of this process's writes (see above)
    state = build()
    ckpt = unbroken.Checkpointer(tmp_path / "run", keep_last=None, preemption=None, async_save=mode)
    ckpt.restore(state)

    def broken(staging, fname, entries):
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(persist, "write_tensors", broken)
    ckpt.save(state)
    with pytest.raises(unbroken.StorageError, match="Input/output"):
        ckpt.close()
    monkeypatch.undo()
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as again:  # the run was released
        assert again.restore(build()) is None


@pytest.mark.parametrize("mode", MODES)
def test_the_process_does_not_end_before_the_last_save_committed(tmp_path: Path, mode: Any) -> None:
    """A script that saves in the background as its very last act and returns: the interpreter's
    exit waits for the commit (the Checkpointer is closed at exit). With a lazy save, whose
    writer waits for the next optimizer step to judge the copy, nothing hangs either."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import time, torch, unbroken
        from unbroken.checkpoint import persist
        from unbroken.checkpoint.background.filewriter import FileWriter
        real, real_process = persist.write_tensors, FileWriter.write
        def slow(*a):
            time.sleep(0.5)
            return real(*a)
        def slow_process(*a, **k):
            time.sleep(0.5)
            return real_process(*a, **k)
        persist.write_tensors, FileWriter.write = slow, slow_process
        w = torch.nn.Parameter(torch.arange(1000.0))
        opt = torch.optim.SGD([w], lr=1.0)
        state = {{"w": w, "optimizer": opt}}
        ckpt = unbroken.Checkpointer({str(tmp_path / "run")!r}, async_save={mode!r}, preemption=None)
        ckpt.restore(state)
        ckpt.progress.step = 7
        assert ckpt.save(state) is None
        w.grad = torch.ones(1000)
        opt.step()  # the loop goes on: the checkpoint keeps the values of step 7
        print("returning", flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "returning" in out.stdout, out.stderr
    loaded = unbroken.load(tmp_path / "run" / "step-000000007")
    assert torch.equal(loaded["w"], torch.arange(1000.0))


def test_exit_without_another_step_commits_a_lazy_save(tmp_path: Path) -> None:
    """The last act is a lazy save, and no optimizer step follows to release its writer: the
    interpreter's exit still waits for the commit, and does not hang."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import torch, unbroken
        w = torch.nn.Parameter(torch.arange(1000.0))
        state = {{"w": w, "optimizer": torch.optim.SGD([w], lr=1.0)}}
        ckpt = unbroken.Checkpointer({str(tmp_path / "run")!r}, async_save="lazy", preemption=None)
        ckpt.restore(state)
        ckpt.progress.step = 3
        assert ckpt.save(state) is None
        print("returning", flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "returning" in out.stdout, out.stderr
    assert torch.equal(unbroken.load(tmp_path / "run" / "step-000000003")["w"], torch.arange(1000.0))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reference")
    assert run_attempt(cmd(base), "none", "", SLOW).ended == "finished"
    return base / "out"


def cmd(base: Path, *extra: str, mode: str = "copy") -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out", str(base / "out"),
            "--steps", "30", "--save-every", "5", "--hidden", "64", "--seed", "3", "--async-save", mode, *extra]


# both in the 2nd save (step 10; the demo writes 3 tensor files per save)
@pytest.mark.parametrize("mode", ["copy", "lazy"])
@pytest.mark.parametrize("point,nth", [("save.mid_file", 5), ("save.before_commit", 2)])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_while_a_background_write_is_in_flight_resumes_bitwise(
        reference: Path, tmp_path: Path, point: str, nth: int, mode: str) -> None:
    att = run_attempt(cmd(tmp_path, mode=mode), "save", f"{point}={nth}", SLOW)
    assert att.ended.startswith("killed in a save"), att
    assert not (tmp_path / "run" / "quarantine").exists()
    att = run_attempt(cmd(tmp_path, mode=mode), "none", "", SLOW)
    assert att.ended == "finished" and att.started.startswith("resumed from step"), att
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results


@pytest.mark.parametrize("mode", ["copy", "lazy"])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_an_exception_while_a_background_save_is_in_flight_resumes_bitwise(
        reference: Path, tmp_path: Path, mode: str) -> None:
    """The demo job raises after the optimizer step of step 11, while step 10's save is being
    written in the background (slowed to over a second): the guard waits for that save to
    commit, writes the emergency checkpoint of step 11, and the resume is exact."""
    flags = ("--crash-after-opt", "11")
    att = run_attempt(cmd(tmp_path, *flags, mode=mode), "none", "", SLOW, ok_codes=(1,))
    assert att.rc == 1 and "injected failure" in att.stderr and "emergency checkpoint" in att.stderr, att
    att = run_attempt(cmd(tmp_path, *flags, mode=mode), "none", "", SLOW)
    assert att.ended == "finished" and att.started == "resumed from step 11", att
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results


# ---------------------------------------------------------------- unbroken.save(async_save=True)
def test_unbroken_save_in_the_background_keeps_the_values_of_the_call(tmp_path: Path, slow_writes: list[str]) -> None:
    state = build()
    want = snapshot(state)
    pending = unbroken.save(tmp_path / "a", state, step=5, async_save=True)
    assert isinstance(pending, unbroken.PendingSave) and not pending.done()
    one_step(state)  # training goes on while the checkpoint is written
    info = pending.wait()
    assert info.step == 5 and pending.done() and slow_writes[0].startswith("unbroken-save")
    have = build()
    unbroken.load(tmp_path / "a", have)
    got = snapshot(have)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # a second background save (the first was collected)
    again = unbroken.save(tmp_path / "b", state, async_save=True).wait()
    assert again.step == 0 and unbroken.verify(tmp_path / "b").step == 0


def test_unbroken_save_failure_is_raised_by_wait_or_by_the_next_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = persist.write_tensors

    def broken(staging, fname, entries):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(persist, "write_tensors", broken)
    state = build()
    with pytest.raises(unbroken.StorageError, match="No space"):
        unbroken.save(tmp_path / "a", state, async_save=True).wait()
    unseen = unbroken.save(tmp_path / "b", state, async_save=True)  # nobody waits for this one
    while not unseen.done():
        time.sleep(0.01)
    monkeypatch.setattr(persist, "write_tensors", real)
    with pytest.raises(unbroken.StorageError, match="No space"):
        unbroken.save(tmp_path / "c", state, async_save=True)  # ... so the next save raises it
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    unbroken.save(tmp_path / "c", state, async_save=True).wait()
    unbroken.verify(tmp_path / "c")


def test_unbroken_save_in_the_background_is_committed_before_the_process_ends(tmp_path: Path) -> None:
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(f"""
        import time, torch, unbroken
        from unbroken.checkpoint import persist
        from unbroken.checkpoint.background.filewriter import FileWriter
        real, real_process = persist.write_tensors, FileWriter.write
        def slow(*a):
            time.sleep(0.5)
            return real(*a)
        def slow_process(*a, **k):
            time.sleep(0.5)
            return real_process(*a, **k)
        persist.write_tensors, FileWriter.write = slow, slow_process
        w = torch.arange(1000.0)
        unbroken.save({str(tmp_path / "ckpt")!r}, {{"w": w}}, async_save=True)
        w.zero_()
        print("returning", flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "returning" in out.stdout, out.stderr
    assert torch.equal(unbroken.load(tmp_path / "ckpt")["w"], torch.arange(1000.0))
