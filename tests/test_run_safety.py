"""Run-folder safety: one writer per run, stale locks, free space, ENOSPC in the middle of a save."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import InsufficientSpaceError
from unbroken.store.local import LocalStore as LocalStorage
from unbroken.errors import RunLockedError

HOLDER = textwrap.dedent("""
    import sys, time, torch, unbroken
    ckpt = unbroken.Checkpointer(sys.argv[1], preemption=None)
    ckpt.restore({"w": torch.zeros(2)})
    print("locked", flush=True)
    time.sleep(120)
""")


def _start_holder(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _start_holder(run)
    try:
        ckpt = unbroken.Checkpointer(run, preemption=None)
        with pytest.raises(RunLockedError, match=rf"another process \(host \S+ pid {holder.pid}\)"):
            ckpt.restore({"w": torch.zeros(2)})
        with pytest.raises(RunLockedError):
            ckpt.save({"w": torch.zeros(2)})
        assert not [p for p in run.iterdir() if p.name.startswith("step-")]
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_killed_writer_is_recovered(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = _start_holder(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with unbroken.Checkpointer(run, preemption=None) as ckpt:  # the kernel released the dead holder's lock
        ckpt.restore({"w": torch.zeros(2)})
        assert ckpt.save({"w": torch.ones(2)}).step == 0


def test_one_process_may_hold_several_checkpointers_on_a_run(tmp_path: Path) -> None:
    a = unbroken.Checkpointer(tmp_path / "run", preemption=None)
    b = unbroken.Checkpointer(tmp_path / "run", preemption=None)
    a.save({"w": torch.zeros(2)})
    b.restore({"w": torch.zeros(2)})  # (saving into a run with checkpoints needs a restore first)
    b.save({"w": torch.zeros(2)})
    a.close()
    b.close()
    holder = _start_holder(tmp_path / "run")  # all released: another process can take it
    holder.kill()
    holder.wait()


def test_not_enough_space_fails_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, preemption=None, keep_last=2)
    state = {"w": torch.randn(1000)}
    ckpt.save(state)
    monkeypatch.setattr(LocalStorage, "free_bytes", lambda self: 1000)
    ckpt.progress.step = 1
    with pytest.raises(InsufficientSpaceError, match="needs about .* MB are free"):
        ckpt.save(state)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith((".", "index.sqlite"))) == ["step-000000000"]
    assert not [p for p in run.iterdir() if p.name.startswith(".staging")]
    unbroken.verify(run / "step-000000000")


class _FullDiskFile:
    """Wraps a staging file: raises ENOSPC after ``budget`` bytes, as a full disk would."""

    budget = 0

    def __init__(self, inner) -> None:
        self.inner = inner

    def write(self, data) -> int:
        n = len(memoryview(data))
        if _FullDiskFile.budget < n:
            raise OSError(errno.ENOSPC, "No space left on device")
        _FullDiskFile.budget -= n
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.inner.__exit__(*exc)


def test_enospc_in_the_middle_of_a_save_keeps_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault-injecting storage: the disk fills up half-way through a tensor file."""
    from unbroken.store import local

    run = tmp_path / "run"
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    ckpt = unbroken.Checkpointer(run, preemption=None, keep_last=1)
    first = ckpt.save(state)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real_open = local.LocalStaging.open
    monkeypatch.setattr(local.LocalStaging, "open", lambda self, f: _FullDiskFile(real_open(self, f)))
    _FullDiskFile.budget = 9000  # the model file is ~16.9 kB
    ckpt.progress.step = 1
    with pytest.raises(OSError) as err:
        ckpt.save(state)
    assert err.value.errno == errno.ENOSPC
    # the earlier checkpoint is intact (keep_last=1 did not delete it), nothing half-written is visible
    assert [c.name for c in ckpt.checkpoints()] == [first.name]
    unbroken.verify(run / first.name)
    assert not [p for p in run.iterdir() if p.name.startswith(".staging")]
    # the disk frees up: the run continues and saves
    monkeypatch.setattr(local.LocalStaging, "open", real_open)
    with torch.no_grad():
        model.weight.add_(1)
    ckpt.progress.step = 2
    assert ckpt.save(state).step == 2
    assert [c.step for c in ckpt.checkpoints()] == [2]
    fresh = torch.nn.Linear(64, 64)
    unbroken.Checkpointer(run, preemption=None).restore({"model": fresh, "optimizer": torch.optim.SGD(
        fresh.parameters(), lr=0.1)})
    assert torch.equal(fresh.weight, before["weight"] + 1)


@pytest.fixture
def tiny_fs(tmpfs) -> Path:
    return tmpfs("7m")


def test_real_full_filesystem(tiny_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 7 MB filesystem: the pre-check refuses, and a real ENOSPC mid-write loses nothing."""
    run = tiny_fs / "run"
    state = {"w": torch.randn(625_000)}  # 2.5 MB
    ckpt = unbroken.Checkpointer(run, preemption=None, keep_last=None)
    ckpt.save(state)
    ckpt.progress.step = 1
    ckpt.save(state)
    ckpt.progress.step = 2
    with pytest.raises(InsufficientSpaceError):
        ckpt.save(state)  # 5 MB used of 7: the third does not fit
    # a filesystem that misreports free space (quotas, thin provisioning): the kernel says ENOSPC
    monkeypatch.setattr(LocalStorage, "free_bytes", lambda self: 1 << 40)
    with pytest.raises(OSError) as err:
        ckpt.save(state)
    assert err.value.errno == errno.ENOSPC
    assert [c.step for c in ckpt.checkpoints()] == [1, 0]
    for c in ckpt.checkpoints():
        unbroken.verify(c.path)
    assert not [p for p in run.iterdir() if p.name.startswith(".staging")]
