"""Incremental checkpoints end to end: real training subprocesses (the demo job with a frozen first
layer, so its chunks are shared by every checkpoint) killed with real SIGKILLs at random steps,
inside saves and inside the garbage collection of chunks; every committed checkpoint must verify,
the run must resume bitwise identical to an uninterrupted one, and no chunk may be left that no
checkpoint uses once a later writer has run.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

import unbroken
from unbroken.demo import compare, run_attempt
from unbroken.checkpoint.reader import read_manifest
from unbroken.store import open_store

pytestmark = pytest.mark.e2e

STEPS, SAVE_EVERY, HIDDEN = 60, 5, 256
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cmd(base: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out",
            str(base / "out"), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--hidden", str(HIDDEN), "--seed", "5", "--freeze-first", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted, with full (not incremental) checkpoints: incremental saving must not change
    anything about the training."""
    base = tmp_path_factory.mktemp("reference")
    att = run_attempt(cmd(base), "none", "", ENV)
    assert att.ended == "finished" and att.last_step == STEPS
    return base / "out"


def finish(base: Path, *extra: str) -> None:
    att = run_attempt(cmd(base, "--incremental", *extra), "none", "", ENV)
    assert att.ended == "finished", att


def check_run(run: Path) -> None:
    """Every committed checkpoint verifies, and the chunks folder holds exactly the chunks the
    committed checkpoints use (a writer ran after every interruption, so garbage is gone)."""
    store = open_store(run)
    names = store.list_committed()
    assert names
    used: set[str] = set()
    for name in names:
        unbroken.verify(run / name)
        used |= set(read_manifest(store, name).chunks)
    assert set(store.list_chunks()) == used
    assert not [p for p in (run / "chunks").iterdir() if p.name.startswith(".")]  # no half-written chunk


def test_frozen_layer_is_written_once(reference: Path, tmp_path: Path) -> None:
    finish(tmp_path)
    store = open_store(tmp_path / "run")
    manifests = [read_manifest(store, n) for n in store.list_committed()]
    assert len(manifests) == 3 and all(m.format_version == 3 for m in manifests)
    shared = set.intersection(*(set(m.chunks) for m in manifests))
    frozen = (HIDDEN * 30 + HIDDEN) * 4  # demo's first layer: 30 features -> HIDDEN, float32
    assert sum(manifests[0].chunks[c].size for c in shared) >= frozen
    check_run(tmp_path / "run")
    assert all(compare(reference, tmp_path / "out").values())


@pytest.mark.parametrize("seed", [21, 22])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_at_random_steps(reference: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    for target in sorted(rng.sample(range(2, STEPS - 3), 4)):
        att = run_attempt(cmd(tmp_path, "--incremental"), "step", str(target), ENV)
        assert att.ended.startswith("killed"), att
    finish(tmp_path)
    check_run(tmp_path / "run")
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results


@pytest.mark.parametrize("point,nth", [("save.mid_file", 2), ("save.before_manifest", 3),
                                       ("save.before_commit", 5), ("save.after_commit", 4)])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_inside_a_save(reference: Path, tmp_path: Path, point: str, nth: int) -> None:
    att = run_attempt(cmd(tmp_path, "--incremental"), "save", f"{point}={nth}", ENV)
    assert att.ended.startswith("killed"), att
    run = tmp_path / "run"
    store = open_store(run)
    for name in store.list_committed():  # what the kill left is consistent before any cleanup
        unbroken.verify(run / name)
    finish(tmp_path)
    assert not (run / "quarantine").exists(), "a killed save must not look like corruption"
    check_run(run)
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results


@pytest.mark.parametrize("point,nth", [("gc.after_mark", 1), ("gc.mid_sweep", 2), ("gc.mid_sweep", 5)])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_inside_the_collection(reference: Path, tmp_path: Path, point: str, nth: int) -> None:
    """Retention (keep_last=3) deletes a checkpoint from the 4th save on, then collects its chunks:
    killed there, nothing any committed checkpoint uses is gone, and the next writer finishes it."""
    att = run_attempt(cmd(tmp_path, "--incremental"), "save", f"{point}={nth}", ENV)
    assert att.ended.startswith("killed"), att
    run = tmp_path / "run"
    store = open_store(run)
    left = set(store.list_chunks())
    used = set()
    for name in store.list_committed():
        unbroken.verify(run / name)
        used |= set(read_manifest(store, name).chunks)
    assert used <= left
    assert left - used, "the kill should have left unreferenced chunks behind"
    finish(tmp_path)
    check_run(run)
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results


@pytest.mark.parametrize("mode", ["copy", "lazy"])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_async_incremental_killed(reference: Path, tmp_path: Path, mode: str) -> None:
    """Background saves hash and write chunks in the writer thread; kills at a random step and inside
    a background save."""
    rng = random.Random(len(mode))
    att = run_attempt(cmd(tmp_path, "--incremental", "--async-save", mode), "step", str(rng.randint(12, 30)), ENV)
    assert att.ended.startswith("killed"), att
    att = run_attempt(cmd(tmp_path, "--incremental", "--async-save", mode), "save", "save.mid_file=3", ENV)
    assert att.ended.startswith("killed"), att
    finish(tmp_path, "--async-save", mode)
    check_run(tmp_path / "run")
    results = compare(reference, tmp_path / "out")
    assert all(results.values()), results
