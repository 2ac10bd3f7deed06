"""A RAM checkpoint belongs to exactly one run (issue 33 §1): the RAM folder is keyed by the run's id
(``run-id`` in the run folder, created once, not derived from its path) as well as its path; a run
made again at the same path, or another mount of the same path (a container's volume) holding a
copy of the run, never restores, prunes or persists the other's RAM checkpoints, and two live
trainers on one RAM folder are refused; the RAM folder removed under a running trainer costs a
warning, never the training loop.

Every test puts the RAM root in its temporary folder; the mount test runs the second trainer in
its own mount namespace (``unshare -m``, root), as a second container on the node would.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import StorageError
from unbroken.run.index.index import RunIndex


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(4, 4)}


def _tier(tmp: Path) -> unbroken.RamTier:
    return unbroken.RamTier(keep_last=2, persist_every=100, root=str(tmp / "shm"))


def _ram_folders(tmp: Path) -> list[Path]:
    root = tmp / "shm" / f"unbroken-{os.getuid()}"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _crash_after(run: Path, tmp: Path, steps: int, seed: int = 0) -> None:
    """Train ``steps`` steps with the RAM tier (persisted only at step 100: never) and crash: the RAM
    folder is kept for a relaunch, and the disk has nothing newer than the persist at the crash."""
    with pytest.raises(RuntimeError, match="crash"):
        with unbroken.Checkpointer(run, save_every=1, ram=_tier(tmp)) as ckpt:
            state = _state(seed)
            ckpt.restore(state)
            for _ in range(steps):
                ckpt.step(state)
            raise RuntimeError("crash")


def test_a_run_made_again_at_the_same_path_never_restores_the_old_runs_ram_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _crash_after(run, tmp_path, 5)
    [old] = _ram_folders(tmp_path)
    old_files = sorted(p.name for p in old.iterdir())
    shutil.rmtree(run)  # rm -rf runs/exp1, then a new experiment there
    with unbroken.Checkpointer(run, save_every=1, ram=_tier(tmp_path)) as ckpt:
        assert ckpt.restore(_state(1)) is None  # a new run: not the old run's step 5 from memory
        ckpt.step(_state(1))
        assert [c.step for c in ckpt.checkpoints()] == [1]
    assert old.is_dir() and sorted(p.name for p in old.iterdir()) == old_files  # never pruned nor persisted
    assert (run / "run-id").read_text().strip() != ""
    assert not (run / "step-000000005").exists()


def test_the_relaunch_of_the_same_run_still_resumes_from_memory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _crash_after(run, tmp_path, 5)
    run_id = (run / "run-id").read_text()
    with unbroken.Checkpointer(run, save_every=1, ram=_tier(tmp_path)) as ckpt:
        info = ckpt.restore(_state(1))
        assert info is not None and info.step == 5 and info.tiers == ("ram",)
    assert (run / "run-id").read_text() == run_id  # created once
    with RunIndex(str(run), readonly=True) as index:
        assert [e["data"]["tier"] for e in index.events("resumed")] == ["ram"]


def test_the_next_start_keeps_a_deleted_runs_ram_folder_it_cannot_tell_is_unneeded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Orphan collection removes a dead run's RAM folder only when that run's disk has everything in
    it; the RAM folder of a run whose path now holds another run (another id) is kept and named."""
    _crash_after(tmp_path / "run", tmp_path, 5)
    [old] = _ram_folders(tmp_path)
    shutil.rmtree(tmp_path / "run")
    with unbroken.Checkpointer(tmp_path / "run", save_every=1) as ckpt:  # another run there now, further on
        state = _state(1)
        ckpt.restore(state)
        for _ in range(10):
            ckpt.step(state)  # (by sequence numbers alone, the old RAM folder would look stale)
    caplog.set_level(logging.INFO, logger="unbroken")
    with unbroken.Checkpointer(tmp_path / "other", save_every=1, ram=_tier(tmp_path)) as ckpt:  # collects orphans
        ckpt.step(_state())
    assert old.is_dir() and "keeping" in caplog.text and "is not the run now at" in caplog.text


def test_the_ram_folder_removed_under_a_running_trainer_costs_a_warning_not_the_loop(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A /dev/shm cleaner (systemd's RemoveIPC) removes the whole RAM root mid-run: the next RAM save
    warns, makes the folder again (private, marked), and training goes on from memory."""
    run = tmp_path / "run"
    state = _state()
    with unbroken.Checkpointer(run, save_every=1, ram=_tier(tmp_path)) as ckpt:
        ckpt.restore(state)
        for step in range(1, 7):
            ckpt.step(state)
            if step == 3:
                shutil.rmtree(tmp_path / "shm")
        assert "was removed (or replaced) under this running process" in caplog.text
        assert [c.step for c in ckpt.checkpoints() if "ram" in c.tiers] == [6, 5]
        [folder] = _ram_folders(tmp_path)
        assert (folder.stat().st_mode & 0o777) == 0o700 and (folder.parent.stat().st_mode & 0o777) == 0o700
    assert caplog.text.count("was removed (or replaced)") == 1


def test_a_second_live_trainer_on_one_ram_folder_is_refused(tmp_path: Path) -> None:
    """The run lock keeps two trainers off one run folder; the same run folder reached through
    another mount of the same path on this node (a second container with a copy of the volume: the
    same path, the same run id, another lock) is refused by the RAM folder's own lock, naming the
    holder, before anything is written."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        why = "needs root and unshare (a mount namespace stands for the second container)"
        if os.environ.get("UNBROKEN_REQUIRE_NETNS"):  # CI (.ci/run): root and namespaces are required
            pytest.fail(why)
        pytest.skip(why)
    run, copy = tmp_path / "run", tmp_path / "volume-copy"
    with unbroken.Checkpointer(run, save_every=1, ram=_tier(tmp_path)) as ckpt:
        state = _state()
        ckpt.restore(state)
        ckpt.step(state)
        shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".lock*"))  # the same run id, another folder
        script = textwrap.dedent(f"""
            import torch, unbroken
            tier = unbroken.RamTier(keep_last=2, persist_every=100, root={str(tmp_path / 'shm')!r})
            with unbroken.Checkpointer({str(run)!r}, save_every=1, ram=tier) as ckpt:
                ckpt.restore({{"model": torch.nn.Linear(4, 4)}})
        """)
        out = subprocess.run(["unshare", "-m", "sh", "-c",
                              f"mount --bind {copy} {run} && exec {sys.executable} -c \"$0\"", script],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and "another live process (pid" in out.stderr, out.stderr
        assert f"pid {os.getpid()} " in out.stderr  # names this trainer
        ckpt.step(state)  # this one trains on
    assert sorted(p.name for p in copy.glob("step-*")) == []  # the second wrote nothing


def test_a_planted_run_id_that_is_not_an_id_is_replaced_with_a_warning(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run-id").write_text("../../etc\n")
    with unbroken.Checkpointer(run, save_every=1, ram=_tier(tmp_path)) as ckpt:
        ckpt.step(_state())
    assert "is not an id; replacing it" in caplog.text
    assert len((run / "run-id").read_text().strip()) == 32


def test_a_run_id_that_is_a_link_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "elsewhere").write_text("f" * 32 + "\n")
    (run / "run-id").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StorageError, match="run-id|link"):
        with unbroken.Checkpointer(run, save_every=1, ram=_tier(tmp_path)) as ckpt:
            ckpt.step(_state())
    assert (tmp_path / "elsewhere").read_text() == "f" * 32 + "\n"  # never written through
