"""The run folder is a boundary at every moment, and a failing filesystem is a clear error.

test_malicious.py covers links present when a Checkpointer is built (the run is refused up
front). Here the links and odd entries appear *later*: between saves, after a checkpoint
was listed, while a checkpoint is being staged; and entries of the wrong kind (a file or a
FIFO where unbroken keeps a folder, a folder where it keeps a file). Then the filesystem
itself fails: full (no inodes left on a small tmpfs the test mounts), read-only, out of
address space for a mapping. Everything is real: real folders, links, FIFOs, mounts and
processes with real resource limits.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import torch

import unbroken
from unbroken.errors import StorageError, UnbrokenError
from unbroken.checkpoint.reader import read_manifest
from unbroken.store import COMMIT_FILE, open_store

CLI = [sys.executable, "-m", "unbroken.cli"]


def fresh_state(seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def train(model: torch.nn.Module, state: dict[str, Any]) -> None:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()


def snapshot_tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative name -> bytes): to prove nothing outside changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def plant(path: Path, kind: str) -> None:
    """An entry of the wrong kind at ``path``: a regular file, a FIFO or a folder."""
    if kind == "file":
        path.write_bytes(b"not what unbroken expects")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "keep.txt").write_text("a user's file")


# ------------------------------------------------------------- chunks/ planted later
def test_a_chunks_link_planted_between_saves_never_leads_a_save_or_collection_outside(tmp_path: Path) -> None:
    """An incremental run; after its first save, ``chunks/`` is replaced by a link to another
    run's chunks. Following it, the next save would write there and its retention would then
    collect the other run's chunks as unreferenced (deleting that run's data). The save is
    refused with a StorageError naming the link; the other run is untouched and still loads."""
    other = tmp_path / "other"
    omodel, ostate = fresh_state(1)
    ockpt = unbroken.Checkpointer(other, incremental=True, keep_last=None)
    for _ in range(2):
        train(omodel, ostate)
        ockpt.save(ostate)
    ockpt.close()
    before = snapshot_tree(other / "chunks")
    assert before

    run = tmp_path / "run"
    model, state = fresh_state(2)
    ckpt = unbroken.Checkpointer(run, incremental=True, keep_last=1)
    ckpt.save(state)
    shutil.rmtree(run / "chunks")
    (run / "chunks").symlink_to(other / "chunks", target_is_directory=True)
    train(model, state)
    with pytest.raises(StorageError, match="chunks is a symbolic link") as err:
        ckpt.save(state)
    assert err.value.errno == errno.ELOOP
    ckpt.close()
    assert snapshot_tree(other / "chunks") == before
    assert (run / "chunks").is_symlink()
    _, check = fresh_state(9)
    assert unbroken.Checkpointer(other, incremental=True).restore(check) is not None


AFTER = {  # an entry unbroken manages -> what the planted link points at
    "chunks": "dir",
    "quarantine": "dir",
    "tags.json": "file",
    "index.sqlite": "file",
    "index.sqlite-wal": "file",
    ".lock": "file",
    "step-000000003": "dir",
}


@pytest.mark.parametrize("entry", AFTER)
def test_a_link_planted_between_saves_is_never_followed(tmp_path: Path, entry: str) -> None:
    """The approach of test_malicious's PLANTED, but the link appears after the Checkpointer
    was built and saved (so the up-front check has passed): then saves with retention and
    chunk collection, a tag, and a restore that quarantines a damaged checkpoint run. Whatever
    each does (go on, or stop with a library error), the link's target is never written,
    moved or deleted (a link may itself be replaced: ``tags.json`` by its new version, the
    index's files by a new index)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    target = outside / "victim"
    if AFTER[entry] == "dir":
        target.mkdir()
        (target / "keep.txt").write_text("precious")
        (target / ("0" * 64)).write_text("an unreferenced chunk of another run")
    else:
        target.write_bytes(b"precious")
    before = snapshot_tree(outside)

    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, save_every=1, keep_last=1, incremental=True)
    reader = unbroken.Checkpointer(run, keep_last=None, incremental=True)
    train(model, state)
    ckpt.step(state)
    if (run / entry).is_dir():
        shutil.rmtree(run / entry)
    (run / entry).unlink(missing_ok=True)
    (run / entry).symlink_to(target, target_is_directory=AFTER[entry] == "dir")

    for _ in range(3):
        train(model, state)
        try:
            ckpt.step(state)
        except UnbrokenError:  # a library error (StorageError; RunLockedError for .lock; no valid checkpoint)
            pass
    try:
        ckpt.tag("kept")
    except UnbrokenError:  # a library error (StorageError; RunLockedError for .lock; no valid checkpoint)
        pass
    newest = max((p for p in run.iterdir() if p.name.startswith("step-") and not p.is_symlink()),
                 key=lambda p: p.stat().st_mtime)
    for f in newest.iterdir():
        if f.suffix == ".safetensors" or f.name.endswith(".chunkmap.json"):
            f.write_bytes(b"\0" * f.stat().st_size)
    try:
        reader.restore(fresh_state(3)[1])
    except UnbrokenError:  # a library error (StorageError; RunLockedError for .lock; no valid checkpoint)
        pass
    reader.close()
    ckpt.close()
    assert snapshot_tree(outside) == before
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_chunks_entry_of_the_wrong_kind_is_a_clear_error_not_a_raw_oserror(tmp_path: Path, kind: str) -> None:
    """A file or a FIFO named ``chunks`` (planted after the Checkpointer was built): the
    incremental save fails with a StorageError that names it and says what to do, never a
    raw FileExistsError, never a hang on the FIFO; the entry is left as it was."""
    run = tmp_path / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, incremental=True, keep_last=None)
    run.mkdir()
    plant(run / "chunks", kind)
    with pytest.raises(StorageError, match=r"chunks is a (file|FIFO).*not a folder.*move it") as err:
        ckpt.save(state)
    assert err.value.errno == errno.ENOTDIR
    ckpt.close()
    assert not any(p.name.startswith("step-") for p in run.iterdir())
    assert (run / "chunks").exists() and not (run / "chunks").is_dir()


# ----------------------------------------------------------- quarantine/ of the wrong kind
@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_quarantine_entry_of_the_wrong_kind_falls_back_to_the_previous_checkpoint(
        tmp_path: Path, kind: str) -> None:
    """The newest checkpoint is damaged and ``quarantine`` is a file or a FIFO: restore cannot
    move the damaged one aside, says so, and resumes from the previous valid checkpoint;
    ``quarantine`` is left as it was."""
    run = tmp_path / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    ckpt.save(state)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, state)
    newest = ckpt.save(state)
    ckpt.close()
    tensor_file = next(p for p in (run / newest.name).iterdir() if p.suffix == ".safetensors")
    tensor_file.write_bytes(b"\0" * tensor_file.stat().st_size)

    restarted = unbroken.Checkpointer(run, keep_last=None)
    plant(run / "quarantine", kind)
    model2, state2 = fresh_state(5)
    info = restarted.restore(state2)
    restarted.close()
    assert info is not None and info.step == 0
    assert all(torch.equal(v, saved[k]) for k, v in model2.state_dict().items())
    assert (run / newest.name).is_dir()  # not moved anywhere
    assert not (run / "quarantine").is_dir()


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_a_folder_or_fifo_where_a_checkpoint_file_belongs_is_corruption_and_restore_falls_back(
        tmp_path: Path, kind: str) -> None:
    """The newest checkpoint's tensor file is replaced by a folder or a FIFO: verification
    reports it (no raw IsADirectoryError, no hang), restore quarantines it and resumes from
    the previous checkpoint."""
    run = tmp_path / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    ckpt.save(state)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, state)
    newest = ckpt.save(state)
    ckpt.close()
    tensor_file = next(p for p in (run / newest.name).iterdir() if p.suffix == ".safetensors")
    tensor_file.unlink()
    plant(tensor_file, kind)
    with pytest.raises(unbroken.CorruptCheckpointError, match="not a regular file"):
        unbroken.verify(run / newest.name)
    model2, state2 = fresh_state(5)
    info = unbroken.Checkpointer(run, keep_last=None).restore(state2)
    assert info is not None and info.step == 0
    assert all(torch.equal(v, saved[k]) for k, v in model2.state_dict().items())
    assert (run / "quarantine" / newest.name).is_dir()


# ---------------------------------------------------------------- tags.json, .lock
def test_a_folder_named_tags_json_is_a_clear_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    saved = ckpt.save(state)
    plant(run / "tags.json", "dir")
    with pytest.raises(StorageError, match="tags.json|run-level file") as err:
        ckpt.tag("best")
    ckpt.close()
    assert err.value.errno == errno.EISDIR and "move it" in str(err.value)
    assert (run / "tags.json" / "keep.txt").read_text() == "a user's file"
    out = subprocess.run([*CLI, "tag", str(run / saved.name), "best"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr and "tags.json" in out.stderr, out.stderr


@pytest.mark.parametrize("damage", ["not json", "a list", "a folder"])
def test_a_damaged_tags_json_stops_retention_instead_of_unprotecting_the_tagged(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """``tags.json`` protects the checkpoints tagged after their save. Damaged, the tags it held are
    unknown: retention deletes nothing (one warning naming the file and the way out) instead of
    deleting what it protected; once it is readable again, retention goes on (issue 33 §4)."""
    run = tmp_path / "run"
    model, state = fresh_state()
    with unbroken.Checkpointer(run, save_every=1, keep_last=1) as ckpt:
        ckpt.restore(state)
        ckpt.step(state)
        ckpt.tag("best")  # step 1, tagged in tags.json
        ckpt.step(state)
        (run / "tags.json").unlink()
        if damage == "a folder":
            plant(run / "tags.json", "dir")
        else:
            (run / "tags.json").write_text('{"best": ' if damage == "not json" else '["best"]')
        for _ in range(3):
            ckpt.step(state)
        names = sorted(p.name for p in run.glob("step-*"))
        assert names[0] == "step-000000001" and len(names) == 5, names  # nothing deleted, the tagged kept
        assert caplog.text.count("retention deletes nothing until it is fixed or removed") == 1
        if damage == "a folder":
            shutil.rmtree(run / "tags.json")
        (run / "tags.json").write_text('{"best": "step-000000001"}')
        ckpt.step(state)
    assert sorted(p.name for p in run.glob("step-*")) == ["step-000000001", "step-000000006"]  # retention again


def test_a_folder_named_dot_lock_is_a_library_error(tmp_path: Path) -> None:
    """The lock file is a folder: the first save fails with a library error (it says what is
    wrong), not a raw IsADirectoryError."""
    run = tmp_path / "run"
    run.mkdir()
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    plant(run / ".lock", "dir")
    with pytest.raises(UnbrokenError, match=r"\.lock"):
        ckpt.save(state)
    ckpt.close()
    assert (run / ".lock" / "keep.txt").exists()


def test_a_fifo_named_index_sqlite_never_hangs_the_run_log_commands(tmp_path: Path) -> None:
    """sqlite opens the index itself; a read-only open of a FIFO would wait for a writer
    forever. ``unbroken events`` and ``metrics`` use an index rebuilt in memory instead."""
    run = tmp_path / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    ckpt.save(state)
    ckpt.close()
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (run / name).unlink(missing_ok=True)
    os.mkfifo(run / "index.sqlite")
    for command in (["events", str(run)], ["metrics", str(run), "loss"]):
        out = subprocess.run([*CLI, *command], capture_output=True, text=True, timeout=120)  # a hang fails
        assert "Traceback" not in out.stderr, out.stderr
        assert out.returncode == 0 or "no metric was logged" in out.stderr, out.stderr
        assert "rebuilt in memory" in out.stderr
    assert (run / "index.sqlite").is_fifo()


@pytest.mark.parametrize("name,kind", [("index.sqlite", "fifo"), ("index.sqlite-wal", "fifo"),
                                       ("index.sqlite", "dir")])
def test_a_fifo_or_folder_named_for_the_index_never_hangs_or_stops_training(tmp_path: Path, name: str,
                                                                            kind: str) -> None:
    """The training side opens the index for writing (issue 33 §4): a FIFO there would block SQLite's
    first read forever. The index is turned off with a warning, training and saving go on, and the
    planted entry is left as it is. In a subprocess with a bound: a hang fails the test."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "index.sqlite").write_bytes(b"") if name != "index.sqlite" else None
    plant(run / name, kind)
    script = textwrap.dedent(f"""
        import torch, unbroken
        state = {{"w": torch.nn.Linear(2, 2)}}
        with unbroken.Checkpointer({str(run)!r}, save_every=1) as ckpt:
            ckpt.step(state)
            ckpt.step(state)
        print("trained", [c.step for c in ckpt.checkpoints()])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "trained [2, 1]" in out.stdout, out.stderr
    assert "run index disabled" in out.stderr and "is not a regular file" in out.stderr, out.stderr
    assert (run / name).is_fifo() if kind == "fifo" else (run / name).is_dir()


# --------------------------------------------- a checkpoint or staging folder replaced later
def test_a_checkpoint_folder_replaced_by_a_link_after_it_was_listed_is_never_read_through(tmp_path: Path) -> None:
    """Between the listing and the read, ``step-000000001`` becomes a link to a folder outside
    the run holding a *valid* checkpoint (another step): the read refuses the link instead of
    loading the outside checkpoint."""
    run = tmp_path / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    ckpt.save(state)
    train(model, state)
    ckpt.save(state)
    ckpt.close()
    outside = tmp_path / "outside" / "evil"
    shutil.copytree(run / "step-000000000", outside)

    store = open_store(run)
    assert store.list_committed() == ["step-000000000", "step-000000000-2"]
    os.rename(run / "step-000000000-2", tmp_path / "moved-away")
    (run / "step-000000000-2").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StorageError, match="step-000000000-2 is a symbolic link") as err:
        read_manifest(store, "step-000000000-2")
    assert err.value.errno == errno.ELOOP


def test_a_staging_folder_replaced_by_a_link_during_a_save_writes_nothing_outside(tmp_path: Path) -> None:
    """A save is staging its files when someone moves the staging folder away and plants a
    link to an outside folder under its name: the files still written go to the staging
    folder the save made (opened once, without following links), never through the link, and
    the commit refuses to publish whatever is now under the staging name."""
    run = tmp_path / "run"
    store = open_store(run)
    store.ensure()
    staging = store.stage("step-000000030")
    with staging.open("a.bin") as f:
        f.write(b"first")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(staging.path, run / "moved-by-someone")
    staging.path.symlink_to(outside, target_is_directory=True)
    with staging.open("b.bin") as f:
        f.write(b"second")
    with staging.open(COMMIT_FILE) as f:
        f.write(b"{}")
    with pytest.raises(StorageError, match="moved or replaced during the save"):
        staging.commit()
    staging.abort()
    assert list(outside.iterdir()) == []
    assert not (run / "step-000000030").exists() and not (run / "step-000000030").is_symlink()
    assert sorted(p.name for p in (run / "moved-by-someone").iterdir()) == ["a.bin", "b.bin", COMMIT_FILE]


WRITER = textwrap.dedent("""
    import sys, torch, unbroken
    from unbroken.errors import StorageError

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    ckpt = unbroken.Checkpointer(sys.argv[1], keep_last=None)
    try:
        ckpt.save({"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    except StorageError as e:
        print("StorageError", e.errno, e)
        sys.exit(3)
    print("saved")
""")


def test_a_staging_folder_replaced_by_a_link_while_another_process_saves_is_never_written_through(
        tmp_path: Path) -> None:
    """A second process saves; it is frozen (SIGSTOP at the fault point before the manifest)
    while its staging folder is moved away and a link to an outside folder is planted under
    the staging name; then it continues. Its manifest never goes through the link, nothing is
    committed, and the writer exits with a StorageError that says what happened."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    env = dict(os.environ, UNBROKEN_FAULTS="save.before_manifest=1", UNBROKEN_FAULT_ACTION="stop")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        _, status = os.waitpid(writer.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        (staging,) = [p for p in run.iterdir() if p.name.startswith(".staging-")]
        os.rename(staging, run / "moved-by-someone")
        staging.symlink_to(outside, target_is_directory=True)
        os.kill(writer.pid, signal.SIGCONT)
        out, err = writer.communicate(timeout=300)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == 3 and "moved or replaced during the save" in out, out + err
    assert list(outside.iterdir()) == []
    assert not [p for p in run.iterdir() if p.name.startswith("step-")]
    assert COMMIT_FILE in {p.name for p in (run / "moved-by-someone").iterdir()}


# ------------------------------------------------- copies outside the naming rule
@pytest.mark.parametrize("copy_name", ["best copy", "best"])
def test_a_copy_outside_the_naming_rule_never_breaks_a_save_is_kept_and_listed(
        tmp_path: Path, copy_name: str) -> None:
    """``cp -r run/step-000000001 "run/best copy"``: later saves and their retention go on
    (keep_last counts only the Checkpointer's own checkpoints and never deletes the copy, also
    when its name is a valid one such as ``best``), ``unbroken ls`` shows it, and it loads."""
    run = tmp_path / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, save_every=1, keep_last=2)
    for _ in range(2):
        train(model, state)
        ckpt.step(state)
    shutil.copytree(run / "step-000000001", run / copy_name)
    for _ in range(3):
        train(model, state)
        ckpt.step(state)
    ckpt.close()
    names = sorted(p.name for p in run.iterdir() if p.is_dir())
    assert names == sorted([copy_name, "step-000000004", "step-000000005"])
    listed = subprocess.run([*CLI, "ls", str(run)], capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0 and copy_name in listed.stdout, listed.stdout + listed.stderr
    assert unbroken.verify(run / copy_name).step == 1


# ---------------------------------------------------------- a failing filesystem
@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 8 MiB and 64 inodes mounted inside tmp_path, unmounted afterwards."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=64", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def use_up_inodes(folder: Path) -> None:
    filler = folder / "filler"
    filler.mkdir()
    for i in range(10_000):
        try:
            (filler / str(i)).touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC
            return
    raise AssertionError("the filesystem never filled up")


def test_no_room_for_the_run_folder_is_a_storage_error_with_its_errno(small_fs: Path) -> None:
    use_up_inodes(small_fs)
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(small_fs / "run", keep_last=None)
    with pytest.raises(StorageError, match="filesystem is full") as err:
        ckpt.save(state)
    ckpt.close()
    assert err.value.errno == errno.ENOSPC


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_no_room_for_the_staging_folder_is_a_storage_error_and_earlier_checkpoints_stay(
        small_fs: Path, fault: str) -> None:
    """The disk fills up (no inode left) while a run trains, or its filesystem is remounted
    read-only before a restart: the save is a StorageError that keeps the errno and says what
    to do, nothing is left behind, the earlier checkpoint still verifies."""
    run = small_fs / "run"
    model, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    first = ckpt.save(state)
    if fault == "full":
        use_up_inodes(small_fs)
    else:
        ckpt.close()  # a filesystem with files open for writing cannot become read-only
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
        ckpt = unbroken.Checkpointer(run, keep_last=None)
        ckpt.restore(state)  # the restarted training resumes (a read of a read-only run works)
    train(model, state)
    with pytest.raises(StorageError, match="filesystem is full" if fault == "full" else "read-only") as err:
        ckpt.save(state)
    ckpt.close()
    assert not [p for p in run.iterdir() if p.name.startswith(".staging-")]
    assert err.value.errno == (errno.ENOSPC if fault == "full" else errno.EROFS)
    assert unbroken.verify(run / first.name).step == 0


# ----------------------------------------------------------- mapping a large file fails
MAP_SCRIPT = textwrap.dedent("""
    import errno, resource, sys, xxhash
    from unbroken.store import open_store
    from unbroken.errors import StorageError

    run, expected, headroom = sys.argv[1], sys.argv[2], sys.argv[3] == "headroom"
    store = open_store(run)
    h = xxhash.xxh3_128()
    if headroom:  # memory the read may reuse (kept by malloc, see MALLOC_* in the environment)
        spare = bytearray(24 << 20)
        del spare
    vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), resource.RLIM_INFINITY))
    try:
        buf = store.read("step-000000001", "big.bin", 16 << 20, h)
    except StorageError as e:
        print("StorageError", e.errno, e)
    except OSError as e:
        print("raw", type(e).__name__, e)
    else:
        print("read", h.hexdigest() == expected, type(buf).__name__)
""")


@pytest.fixture
def big_file_run(tmp_path: Path) -> tuple[Path, str]:
    import xxhash

    run = tmp_path / "run"
    store = open_store(run)
    store.ensure()
    data = os.urandom(16 << 20)
    staging = store.stage("step-000000001")
    with staging.open("big.bin") as f:
        f.write(data)
    with staging.open(COMMIT_FILE) as f:
        f.write(b"{}")
    staging.commit()
    return run, xxhash.xxh3_128(data).hexdigest()


def run_map_script(run: Path, expected: str, mode: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(32 << 20),
               MALLOC_TRIM_THRESHOLD_=str(1 << 40), MALLOC_ARENA_MAX="1")
    env.pop("UNBROKEN_NO_MMAP", None)
    out = subprocess.run([sys.executable, "-c", MAP_SCRIPT, str(run), expected, mode], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1] + "\n" + out.stderr


def test_a_file_that_cannot_be_mapped_is_read_into_memory_instead(big_file_run: tuple[Path, str]) -> None:
    """Under an address-space limit (``ulimit -v``, common on clusters) mapping a 16 MiB
    tensor file fails with ENOMEM; memory the process already has can still hold it, so the
    file is read (and hashed) into memory instead, with a warning."""
    out = run_map_script(*big_file_run, "headroom")
    assert out.startswith("read True"), out
    assert "could not map big.bin" in out


def test_a_file_that_can_neither_be_mapped_nor_read_is_a_storage_error(big_file_run: tuple[Path, str]) -> None:
    out = run_map_script(*big_file_run, "no-headroom")
    assert out.startswith(f"StorageError {errno.ENOMEM}"), out
    assert "big.bin" in out and "mapping it failed first" in out and "ulimit -v" in out
