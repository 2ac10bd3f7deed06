"""The RAM tier's folders in a place every user can write (issue 33 §1): another local user (a real
other uid, through ``setpriv``) who creates the per-user folder first, plants a symbolic link under its
name or under a run's folder name, or a root without the sticky bit, never gets a trainer to use,
follow, write into or change the mode of what they made; the error names the owner and the way out.

Each test mounts a private tmpfs with ``/dev/shm``'s mode (1777) as the RAM root: nothing touches the
machine's ``/dev/shm``. Needs root (the mount, and ``setpriv`` to act as another user): skipped
without it, as the ``tmpfs`` fixture does.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import StorageError
from unbroken.store import open_store

OTHER = 65534  # nobody


@pytest.fixture
def shm(tmpfs: Callable[[str], Path]) -> Path:
    root = tmpfs("8m")
    os.chmod(root, 0o1777)
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is missing") if os.geteuid() == 0 else pytest.skip("no setpriv")
    return root


def as_other(cwd: Path, *cmd: str) -> None:
    """Run ``cmd`` in ``cwd`` as another user (uid/gid 65534), as a hostile local user would (``cwd`` is
    entered before the privileges are dropped: the test's own folders above it stay closed to them)."""
    subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *cmd], check=True, cwd=cwd)


def train(run: Path, shm: Path, steps: int = 2) -> None:
    torch.manual_seed(0)
    state = {"w": torch.nn.Linear(4, 4, bias=False)}
    with unbroken.Checkpointer(run, save_every=1, ram=unbroken.RamTier(root=str(shm))) as ckpt:
        ckpt.restore(state)
        for _ in range(steps):
            ckpt.step(state)


def run_folder_name(run: Path, shm: Path) -> str:
    """The RAM folder name of ``run``: keyed by its path and its id (``run-id``, written here first as
    the run's first start would; another user who can read the run folder knows it)."""
    run.mkdir(parents=True, exist_ok=True)
    if not (run / "run-id").exists():
        (run / "run-id").write_text("1" * 32 + "\n")
    run_id = (run / "run-id").read_text().strip()
    return unbroken.RamTier(root=str(shm)).folder(open_store(str(run)).identity, run_id).name


def test_a_per_user_folder_made_by_another_user_is_never_used(shm: Path, tmp_path: Path) -> None:
    theirs = shm / f"unbroken-{os.getuid()}"
    as_other(shm, "mkdir", "-m", "0777", theirs.name)
    with pytest.raises(StorageError,
                       match=rf"belongs to (user \S+ )?\(?uid {OTHER}\)?.*never used.*RamTier\(root=") as e:
        train(tmp_path / "run", shm)
    assert "not to you" in str(e.value)
    assert list(theirs.iterdir()) == []  # nothing written into it
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o777 and theirs.stat().st_uid == OTHER  # nor changed


def test_a_link_planted_as_the_per_user_folder_is_never_followed(shm: Path, tmp_path: Path) -> None:
    target = shm / "bait"
    as_other(shm, "mkdir", "-m", "0755", target.name)
    as_other(shm, "ln", "-s", str(target), f"unbroken-{os.getuid()}")
    with pytest.raises(StorageError, match=rf"is a symbolic link, made by (user \S+ )?\(?uid {OTHER}.*never followed"):
        train(tmp_path / "run", shm)
    assert list(target.iterdir()) == [] and stat.S_IMODE(target.stat().st_mode) == 0o755  # not written, not chmod-ed


def test_a_link_planted_as_a_runs_folder_is_never_followed(shm: Path, tmp_path: Path) -> None:
    """The user's own per-user folder left open to others (an older version, a umask): a link planted
    in it under the run's folder name is refused; the per-user folder is made private."""
    mine = shm / f"unbroken-{os.getuid()}"
    mine.mkdir()
    os.chmod(mine, 0o777)
    target = shm / "bait"
    as_other(shm, "mkdir", "-m", "0777", target.name)
    as_other(mine, "ln", "-s", str(target), run_folder_name(tmp_path / "run", shm))
    with pytest.raises(StorageError, match="is a symbolic link.*never followed"):
        train(tmp_path / "run", shm)
    assert list(target.iterdir()) == [] and stat.S_IMODE(target.stat().st_mode) == 0o777
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700


def test_a_run_folder_made_by_another_user_is_never_used(shm: Path, tmp_path: Path) -> None:
    mine = shm / f"unbroken-{os.getuid()}"
    mine.mkdir()
    os.chmod(mine, 0o777)
    theirs = mine / run_folder_name(tmp_path / "run", shm)
    as_other(mine, "mkdir", "-m", "0777", theirs.name)
    with pytest.raises(StorageError, match=rf"belongs to (user \S+ )?\(?uid {OTHER}"):
        train(tmp_path / "run", shm)
    assert list(theirs.iterdir()) == []


def test_a_shared_root_without_the_sticky_bit_is_refused(shm: Path, tmp_path: Path) -> None:
    os.chmod(shm, 0o777)
    with pytest.raises(StorageError, match="without the sticky bit"):
        train(tmp_path / "run", shm)


def test_the_users_own_folders_are_used_and_kept_private(shm: Path, tmp_path: Path) -> None:
    """The control: with nobody else's folders in the way, training goes on, the folders are 0700."""
    mine = shm / f"unbroken-{os.getuid()}"
    mine.mkdir()
    os.chmod(mine, 0o755)
    torch.manual_seed(0)
    state = {"w": torch.nn.Linear(4, 4, bias=False)}
    with unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=unbroken.RamTier(root=str(shm))) as ckpt:
        ckpt.restore(state)
        ckpt.step(state)
        assert stat.S_IMODE(mine.stat().st_mode) == 0o700
        run_dir = mine / run_folder_name(tmp_path / "run", shm)
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700 and (run_dir / "step-000000001").is_dir()
