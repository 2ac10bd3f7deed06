"""The session guard of tests/conftest.py: a test that writes into the repository fails the session.

Checked for real: a pytest session in a subprocess over a scratch copy of the test harness (conftest,
repo_guard, s3_server), with one test that leaves ``checkpoints/*.ckpt`` in the repository root, the
way a Lightning Trainer without ``default_root_dir`` does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_snapshot_sees_writes_anywhere_but_tool_caches(tmp_path: Path) -> None:
    from repo_guard import changes, snapshot

    repo = tmp_path / "repo"
    (repo / "runs" / "old").mkdir(parents=True)  # an ignored folder that already exists
    (repo / "src").mkdir()
    (repo / "src" / "mod.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("untracked\n")
    (repo / "gone.txt").write_text("removed by a test\n")
    before = snapshot(repo)
    (repo / "runs" / "old" / "step-1").mkdir()  # inside an ignored folder: still seen
    (repo / "src" / "__pycache__").mkdir()
    (repo / "src" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")  # a cache: not a finding
    (repo / ".pytest_cache").mkdir()
    (repo / "src" / "mod.py").write_text("x = 2  # edited by an engineer meanwhile\n")  # tracked: not a finding
    (repo / "notes.txt").write_text("overwritten by a test\n")  # untracked: a finding
    (repo / "gone.txt").unlink()
    (repo / "src" / "new_module.py").write_text("# an engineer's new file, written meanwhile\n")
    (repo / "src" / "out.ckpt").write_bytes(b"a test's leak, ignored by git")
    (repo / "src" / "lightning_logs").mkdir()  # a new folder, even among the sources
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    (repo / ".gitignore").write_text("*.ckpt\nruns/\n")
    before[".gitignore"] = snapshot(repo)[".gitignore"]
    found = changes(before, snapshot(repo), {"src/mod.py", ".gitignore"}, repo)
    assert found == ["created: runs/old/step-1", "created: src/lightning_logs", "created: src/out.ckpt",
                     "removed: gone.txt", "modified: notes.txt"]


def _harness(repo: Path, test_body: str) -> subprocess.CompletedProcess[str]:
    tests = repo / "tests"
    tests.mkdir(parents=True)
    for helper in HERE.glob("*.py"):  # the conftest and every helper module it may import (not the tests)
        if not helper.name.startswith("test_"):
            shutil.copy(helper, tests / helper.name)
    (tests / "test_scratch.py").write_text(textwrap.dedent(test_body))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(repo.parent / "basetemp"), str(tests / "test_scratch.py")],
                          cwd=repo, capture_output=True, text=True, timeout=300)


def test_a_test_that_writes_into_the_repository_fails_the_session(tmp_path: Path) -> None:
    leak = _harness(tmp_path / "leaky", """
        from pathlib import Path

        def test_trainer_without_default_root_dir(tmp_path):
            (tmp_path / "fine.txt").write_text("inside tmp_path")
            ckpts = Path.cwd() / "checkpoints"
            ckpts.mkdir()
            (ckpts / "epoch=0-step=4.ckpt").write_bytes(b"pickle")
    """)
    assert leak.returncode == 1, leak.stdout + leak.stderr
    assert "tests changed the repository" in leak.stdout, leak.stdout
    assert "created: checkpoints/epoch=0-step=4.ckpt" in leak.stdout and "fine.txt" not in leak.stdout
    clean = _harness(tmp_path / "clean", """
        def test_writes_only_its_tmp_path(tmp_path):
            (tmp_path / "fine.txt").write_text("inside tmp_path")
    """)
    assert clean.returncode == 0, clean.stdout + clean.stderr
