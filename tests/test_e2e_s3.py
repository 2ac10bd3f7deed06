"""End to end on S3: training runs whose only storage is an S3 bucket, SIGKILLed and resumed.

The same training job as tests/test_e2e_kill.py (unbroken.demo.train: dropout, shuffled
data, augmentation, AdamW, warmup+cosine, gradient accumulation, GradScaler), but with
``--run-dir s3://...`` on the test SeaweedFS server (credentials and endpoint from the
AWS_* variables, as a real job would get them). Each test kills real subprocesses with
SIGKILL, at seeded random steps or inside a save at a fault point (UNBROKEN_FAULTS, see
src/unbroken/_support/faultpoints.py), resumes from S3, and compares the final parameters, optimizer
state, scheduler, scaler and every per-step loss bitwise with an uninterrupted run.

On S3 a checkpoint commits when its manifest.json is PUT, after every data object; a
folder without one is invisible to readers and removed, with any multipart upload left
open, by the next writer. The tests check exactly that on the bucket.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

import unbroken
from unbroken.demo import compare, run_attempt
from unbroken.store import open_store

pytestmark = pytest.mark.e2e

STEPS, SAVE_EVERY, HIDDEN = 30, 5, 64
# Each save writes three tensor files, in this order: model, optimizer, unbroken (RNG state).
# The ``save.mid_file`` point fires half-way through each of them, so its nth hit is in
# save number (nth + 2) // 3.
FILES_PER_SAVE = 3


def cmd(run_dir: str, out: Path, *extra: str, steps: int = STEPS, save_every: int = SAVE_EVERY,
        hidden: int = HIDDEN) -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", run_dir, "--out", str(out),
            "--steps", str(steps), "--save-every", str(save_every), "--hidden", str(hidden), "--seed", "3",
            *extra]


def env_for(s3) -> dict[str, str]:
    """The child's environment: ours (UNBROKEN_CACHE_DIR from conftest) plus the server's AWS_* variables."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **s3.env)


def multipart_uploads(s3, url: str) -> list[str]:
    """Keys of the multipart uploads still open under the run (started, never completed)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    listing = s3.fs().call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
    return [u["Key"] for u in listing.get("Uploads", [])]


def assert_clean(s3, url: str, verify: bool = True) -> None:
    """No leftovers, no open multipart upload, nothing quarantined; each committed checkpoint verifies."""
    store = open_store(url, s3.storage_options)
    for name in store.list_committed() if verify else ():
        unbroken.verify(f"{url}/{name}", storage_options=s3.storage_options)  # manifest, sizes, checksums
    assert store.list_uncommitted() == [], "leftovers of a killed save were not removed"
    assert multipart_uploads(s3, url) == [], "multipart uploads of a killed save were left open"
    assert store.quarantined() is None, "a killed save must not look like corruption"


def uninterrupted(base: Path, **sizes: int) -> Path:
    """The reference: an uninterrupted run that never saves (local folder; only its outputs matter),
    so the comparisons also show that saving to S3 does not perturb training."""
    sizes["save_every"] = 10**6
    local_env = dict(os.environ, PYTHONUNBUFFERED="1")
    att = run_attempt(cmd(str(base / "run"), base / "out", **sizes), "none", "", local_env)
    assert att.ended == "finished" and att.last_step == sizes.get("steps", STEPS), att
    return base / "out"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return uninterrupted(tmp_path_factory.mktemp("reference"))


def test_sigkill_at_random_steps(reference: Path, s3, s3_url: str, tmp_path: Path) -> None:
    """Two SIGKILLs at seeded random steps, each attempt resuming from the bucket."""
    env, out = env_for(s3), tmp_path / "out"
    # every kill comes after the first save, so every attempt after the first resumes
    targets = sorted(random.Random(11).sample(range(SAVE_EVERY + 1, STEPS - 2), 2))
    started = []
    for target in targets:
        att = run_attempt(cmd(s3_url, out), "step", str(target), env)
        assert att.ended.startswith("killed"), att
        started.append(att.started)
    last = run_attempt(cmd(s3_url, out), "none", "", env)
    assert last.ended == "finished", last
    started.append(last.started)
    assert started[0] == "fresh start", started
    for killed_at, line in zip(targets, started[1:], strict=True):
        assert line.startswith("resumed from step "), (targets, started)
        # the newest checkpoint at the kill (the one of the kill's own step may or may not have committed)
        assert killed_at - SAVE_EVERY <= int(line.split()[-1]) <= killed_at, (targets, started)
    assert_clean(s3, s3_url)
    results = compare(reference, out)
    assert all(results.values()), (targets, results)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_inside_saves_at_every_fault_point(reference: Path, s3, s3_url: str, tmp_path: Path) -> None:
    """One run killed inside a save at each fault point in turn, each attempt resuming from the
    bucket; after every kill the bucket shows exactly the checkpoints that committed."""
    env, out = env_for(s3), tmp_path / "out"
    store = open_store(s3_url, s3.storage_options)
    resumed_from = 0
    # (fault spec, number of the save it kills, counted from the attempt's start)
    plan = [(f"save.mid_file={1 + FILES_PER_SAVE}", 2),  # half-way through the model file of save 2
            ("save.before_manifest=2", 2), ("save.before_commit=2", 2), ("save.after_commit=2", 2)]
    for spec, nth_save in plan:
        att = run_attempt(cmd(s3_url, out), "save", spec, env)
        assert att.ended.startswith("killed in a save"), (spec, att)
        expected_start = f"resumed from step {resumed_from}" if resumed_from else "fresh start"
        assert att.started == expected_start, (spec, att)
        died_at = resumed_from + nth_save * SAVE_EVERY
        assert att.last_step == died_at, (spec, att)  # the save of the last printed step is the one killed
        committed = store.list_committed()
        killed = f"step-{died_at:09d}"
        if spec.startswith("save.after_commit"):
            assert killed in committed, (spec, committed)  # the manifest was PUT: it committed
            resumed_from = died_at
        else:
            # the manifest was never PUT, so the killed checkpoint is invisible to readers
            resumed_from = died_at - SAVE_EVERY
            assert killed not in committed and committed[-1] == f"step-{resumed_from:09d}", (spec, committed)
        for name in committed:
            assert s3.fs().exists(f"{s3_url}/{name}/manifest.json"), name
            unbroken.verify(f"{s3_url}/{name}", storage_options=s3.storage_options)  # sizes and checksums
    last = run_attempt(cmd(s3_url, out), "none", "", env)
    assert last.ended == "finished" and last.started == f"resumed from step {resumed_from}", last
    assert_clean(s3, s3_url)
    results = compare(reference, out)
    assert all(results.values()), results


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_during_a_multipart_upload(s3, s3_url: str, tmp_path: Path) -> None:
    """Tensor files larger than the multipart part size (64 MiB; no setting reaches it from outside
    the process): hidden=4200 makes the model file ~72 MB and the optimizer file ~144 MB. Killed
    half-way through the optimizer file of the 2nd save, both files' multipart uploads are open
    (the optimizer's was started at its first 64 MiB, before the half). The next writer must abort
    them, and the run, resumed from large files on S3, must end bitwise equal to an uninterrupted one."""
    big = dict(steps=2, save_every=1, hidden=4200)
    env, out = env_for(s3), tmp_path / "out"
    ref = uninterrupted(tmp_path / "reference", **big)
    att = run_attempt(cmd(s3_url, out, **big), "save", f"save.mid_file={2 + FILES_PER_SAVE}", env)
    assert att.ended.startswith("killed in a save") and att.last_step == 2, att
    store = open_store(s3_url, s3.storage_options)
    assert store.list_committed() == ["step-000000001"]
    left = multipart_uploads(s3, s3_url)
    assert any(k.endswith("/step-000000002/t01-optimizer.safetensors") for k in left), left

    resumed = run_attempt(cmd(s3_url, out, **big), "none", "", env)
    assert resumed.ended == "finished" and resumed.started == "resumed from step 1", resumed
    assert store.list_committed() == ["step-000000001", "step-000000002"]
    assert_clean(s3, s3_url, verify=False)  # (the resume verified step 1's checksums; 430 MB to re-read)
    results = compare(ref, out)
    assert all(results.values()), results


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_incremental_on_s3_killed_at_steps_in_saves_and_in_the_collection(s3, s3_url: str, tmp_path: Path) -> None:
    """Incremental checkpoints (a frozen first layer, so chunks are shared) with the bucket as the
    only storage: SIGKILLs at a seeded random step, inside a save, and inside the collection of
    unused chunks (retention keeps 3). Every committed checkpoint verifies after each kill; at the
    end the bucket's chunks are exactly those the committed checkpoints use; bitwise."""
    from unbroken.checkpoint.reader import read_manifest

    extra = ("--incremental", "--freeze-first")
    env, out = env_for(s3), tmp_path / "out"
    ref = tmp_path / "reference"
    att = run_attempt(cmd(str(ref / "run"), ref / "out", *extra), "none", "", dict(os.environ, PYTHONUNBUFFERED="1"))
    assert att.ended == "finished", att
    store = open_store(s3_url, s3.storage_options)
    plan = [("step", str(random.Random(5).randint(SAVE_EVERY + 1, STEPS - 8))), ("save", "save.mid_file=2"),
            ("save", "gc.mid_sweep=1")]
    for kind, arg in plan:
        att = run_attempt(cmd(s3_url, out, *extra), kind, arg, env)
        assert att.ended.startswith("killed"), (kind, arg, att)
        used: set[str] = set()
        for name in store.list_committed():
            unbroken.verify(f"{s3_url}/{name}", storage_options=s3.storage_options)
            used |= set(read_manifest(store, name).chunks)
        assert used <= set(store.list_chunks())
    last = run_attempt(cmd(s3_url, out, *extra), "none", "", env)
    assert last.ended == "finished", last
    assert_clean(s3, s3_url)
    used = set().union(*(read_manifest(store, n).chunks for n in store.list_committed()))
    assert set(store.list_chunks()) == used
    results = compare(ref / "out", out)
    assert all(results.values()), results
