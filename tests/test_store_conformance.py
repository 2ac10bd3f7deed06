"""One conformance suite every storage backend passes: local folders, ``memory://`` and S3.

Each test receives a fresh, empty run location of one backend (``store`` fixture,
parametrized) opened through :func:`unbroken.store.open_store`, the only way in. What
is checked is the protocol of :mod:`unbroken.store.base`: staged checkpoints are
invisible until committed, commits are whole, names never collide, deletes and
quarantines un-commit first, leftovers of a killed writer are invisible and cleaned,
run-level files are replaced atomically, one writer holds the lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import unbroken
from unbroken.errors import CorruptCheckpointError
from unbroken.store import COMMIT_FILE, open_store

BACKENDS = ["local", "memory", "s3"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture()
def location(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict | None]:
    if backend == "local":
        return str(tmp_path / "run"), None
    if backend == "memory":
        return f"memory://unbroken-tests/{uuid.uuid4().hex}/run", None
    s3 = request.getfixturevalue("s3")
    return f"s3://{s3.new_prefix()}/run", s3.storage_options


@pytest.fixture()
def store(location: tuple[str, dict | None]):
    return open_store(location[0], location[1])


def commit(store, name: str, files: dict[str, bytes], manifest: bytes = b"{}") -> str:
    staging = store.stage(name)
    try:
        for fname, data in files.items():
            with staging.open(fname) as f:
                f.write(data)
        with staging.open(COMMIT_FILE) as f:
            f.write(manifest)
        return staging.commit()
    except BaseException:
        staging.abort()
        raise


def test_an_empty_location_has_no_checkpoints(store) -> None:
    store.check()
    assert store.list_committed() == [] and store.list_uncommitted() == []
    assert store.read_meta("tags.json") is None and store.quarantined() is None


def test_committed_checkpoint_reads_back_exactly(store) -> None:
    payload = os.urandom(100_003)
    assert commit(store, "step-000000001", {"a.bin": payload, "b.bin": b""}) == "step-000000001"
    assert store.list_committed() == ["step-000000001"]
    assert bytes(store.read("step-000000001", "a.bin", len(payload))) == payload
    assert bytes(store.read("step-000000001", "b.bin", 0)) == b""
    assert bytes(store.read("step-000000001", COMMIT_FILE)) == b"{}"
    assert store.describe("step-000000001").endswith("run/step-000000001")


def test_wrong_size_and_missing_files_are_corruption(store) -> None:
    commit(store, "c", {"a.bin": b"12345"})
    with pytest.raises(CorruptCheckpointError, match="5 bytes, the manifest says 6"):
        store.read("c", "a.bin", 6)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        store.read("c", "nope.bin", 1)


def test_large_files_go_in_parts_and_come_back_whole(store, backend: str) -> None:
    if backend != "local":
        store.part_size = 5 * 1024 * 1024  # S3's smallest part: 3 parts and a short last one
    payload = os.urandom(13 * 1024 * 1024 + 17)
    staging = store.stage("big")
    with staging.open("big.bin") as f:
        for i in range(0, len(payload), 3_000_001):  # writes that do not align with parts
            f.write(memoryview(payload)[i:i + 3_000_001])
    with staging.open(COMMIT_FILE) as f:
        f.write(b"{}")
    staging.commit()
    assert bytes(store.read("big", "big.bin", len(payload))) == payload


def test_a_staged_checkpoint_is_invisible_until_commit(store) -> None:
    staging = store.stage("s")
    with staging.open("a.bin") as f:
        f.write(b"data")
    with staging.open(COMMIT_FILE) as f:
        f.write(b"{}")
    assert store.list_committed() == []
    staging.commit()
    assert store.list_committed() == ["s"]


def test_abort_leaves_nothing(store) -> None:
    staging = store.stage("s")
    with staging.open("a.bin") as f:
        f.write(b"data")
    staging.abort()
    assert store.list_committed() == [] and store.list_uncommitted() == []


def test_names_never_collide(store) -> None:
    assert commit(store, "step-000000005", {"a.bin": b"1"}) == "step-000000005"
    assert commit(store, "step-000000005", {"a.bin": b"2"}) == "step-000000005-2"
    assert bytes(store.read("step-000000005", "a.bin", 1)) == b"1"
    assert bytes(store.read("step-000000005-2", "a.bin", 1)) == b"2"


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "", "x" * 300])
def test_unsafe_names_are_refused(store, bad: str) -> None:
    with pytest.raises(CorruptCheckpointError):
        store.stage(bad)
    staging = store.stage("ok")
    try:
        with pytest.raises(CorruptCheckpointError):
            staging.open(bad)
        with pytest.raises(CorruptCheckpointError):
            store.read("ok", bad, 1)
    finally:
        staging.abort()


def test_delete_removes_the_whole_checkpoint(store) -> None:
    commit(store, "a", {"x.bin": b"1"})
    commit(store, "b", {"x.bin": b"2"})
    store.delete("a")
    assert store.list_committed() == ["b"] and store.list_uncommitted() == []


def test_quarantine_moves_it_aside_with_the_reason(store) -> None:
    commit(store, "bad", {"x.bin": b"1"})
    moved = store.quarantine("bad", "x.bin: checksum mismatch")
    assert moved and "quarantine" in moved
    assert store.list_committed() == []
    q = store.quarantined()
    assert q is not None and q.list_committed() == ["bad"]
    assert bytes(q.read("bad", "x.bin", 1)) == b"1"
    # a new checkpoint of the same name does not collide with the quarantined one
    assert commit(store, "bad", {"x.bin": b"2"}) == "bad-2"


def test_meta_files_are_replaced_whole(store) -> None:
    store.write_meta("tags.json", b'{"a": "b"}')
    store.write_meta("tags.json", b'{"c": "d"}')
    assert store.read_meta("tags.json") == b'{"c": "d"}'
    assert store.list_committed() == []


def test_meta_files_are_bounded(store) -> None:
    store.write_meta("tags.json", b" " * (2 << 20))
    with pytest.raises(CorruptCheckpointError, match="implausibly large"):
        store.read_meta("tags.json")


def test_the_lock_is_shared_in_a_process_and_released(store) -> None:
    a, b = store.lock(), store.lock()
    a.acquire()
    b.acquire()  # same process: shared (reference-counted), like two Checkpointers on one run
    assert a.held and b.held
    a.verify()
    b.release()
    a.release()
    assert not a.held
    c = store.lock()
    c.acquire()
    c.release()


def test_the_local_dir_is_a_local_folder(store) -> None:
    d = store.local_dir()
    d.mkdir(parents=True, exist_ok=True)
    assert d.is_dir()


# ------------------------------------------------- across processes (not memory://: per process)
CHILD = textwrap.dedent("""
    import faulthandler
    faulthandler.dump_traceback_later(100, exit=True)  # a hang ends with every thread's stack on stderr
    import json, os, signal, sys
    from unbroken.store import open_store, COMMIT_FILE
    url, opts, what = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    store = open_store(url, opts or None)
    if what == "die-mid-save":
        lock = store.lock(); lock.acquire()
        staging = store.stage("step-000000009")
        with staging.open("a.bin") as f:
            f.write(b"half")
        for upload in getattr(staging, "futures", []):  # object stores upload in the background
            upload.result()
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "hold-lock":
        lock = store.lock(); lock.acquire()
        print("locked", flush=True)
        sys.stdin.readline()
        lock.release()
    if what == "try-lock":
        try:
            store.lock().acquire()
        except Exception as e:
            print(type(e).__name__, e, flush=True)
            sys.exit(3)
        print("acquired", flush=True)
""")


def _child(location: tuple[str, dict | None], what: str, **kw) -> subprocess.Popen:
    import json

    return subprocess.Popen([sys.executable, "-c", CHILD, location[0], json.dumps(location[1] or {}), what],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_killed_writer_leaves_nothing_visible_and_is_cleaned(location, store) -> None:
    commit(store, "step-000000001", {"a.bin": b"ok"})
    child = _child(location, "die-mid-save")
    child.wait(timeout=60)
    assert child.returncode == -9
    assert store.list_committed() == ["step-000000001"]
    assert store.list_uncommitted() == ["step-000000009"]
    lock = store.lock()
    lock.acquire()  # the dead writer's lock is taken over at once (same host, process gone)
    try:
        assert store.clean_stale()
        assert store.list_uncommitted() == [] and store.list_committed() == ["step-000000001"]
    finally:
        lock.release()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_second_writer_is_refused_while_the_first_lives(location, store) -> None:
    holder = _child(location, "hold-lock")
    try:
        assert holder.stdout.readline().strip() == "locked"
        other = _child(location, "try-lock")
        out, err = other.communicate(timeout=150)
        assert other.returncode == 3 and "RunLockedError" in out and str(holder.pid) in out, out + err
    finally:
        holder.communicate("\n", timeout=150)
    after = _child(location, "try-lock")
    out, err = after.communicate(timeout=150)
    assert after.returncode == 0 and "acquired" in out, out + err


# -------------------------------------------------- the Checkpointer on every backend
def test_a_checkpointer_round_trip_on_every_backend(location) -> None:
    import torch

    url, opts = location
    model = torch.nn.Linear(8, 4)
    state = {"model": model, "step_data": {"epoch": 2}}
    with unbroken.Checkpointer(url, storage_options=opts, preemption=None, keep_last=2) as ckpt:
        for step in range(1, 4):
            with torch.no_grad():
                model.weight.add_(1)
            ckpt.progress.step = step
            ckpt.save(state)
        assert [c.step for c in ckpt.checkpoints()] == [3, 2]
    fresh = torch.nn.Linear(8, 4)
    with unbroken.Checkpointer(url, storage_options=opts, preemption=None) as ckpt:
        info = ckpt.restore({"model": fresh, "step_data": {}})
        assert info.step == 3 and ckpt.progress.step == 3
    assert torch.equal(fresh.weight, model.weight)
    assert unbroken.verify(f"{url}/step-000000003", storage_options=opts).step == 3
    loaded = unbroken.load(f"{url}/step-000000002", storage_options=opts)
    assert loaded["step_data"] == {"epoch": 2}


# ------------------------------------------------------------------ chunks (incremental checkpoints)
def test_chunks_round_trip_list_delete_and_stay_out_of_checkpoint_listings(store, backend: str) -> None:
    import hashlib

    if backend != "local":
        store.part_size = 5 * 1024 * 1024  # a multipart chunk: 3 parts and a short last one
    big = os.urandom(13 * 1024 * 1024 + 5)
    small = b"tiny chunk"
    ids = {hashlib.sha256(d).hexdigest(): d for d in (big, small, b"")}
    for cid, data in ids.items():
        store.put_chunk(cid, memoryview(data))
    store.put_chunk(hashlib.sha256(small).hexdigest(), small)  # again: harmless
    listed = store.list_chunks()
    assert set(listed) == set(ids) and all(t > 0 for t in listed.values())
    for cid, data in ids.items():
        assert bytes(store.read_chunk(cid, len(data))) == data
    # the chunks folder is neither a checkpoint nor a leftover a writer would remove
    assert store.list_committed() == [] and store.list_uncommitted() == []
    assert store.clean_stale() == [] and set(store.list_chunks()) == set(ids)
    with pytest.raises(CorruptCheckpointError, match="bytes, the manifest says|size"):
        store.read_chunk(hashlib.sha256(small).hexdigest(), len(small) + 1)
    gone = hashlib.sha256(big).hexdigest()
    store.delete_chunk(gone)
    store.delete_chunk(gone)  # already gone: fine
    assert gone not in store.list_chunks()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        store.read_chunk(gone, len(big))


def test_a_quarantined_chunk_is_moved_aside_with_its_reason(store) -> None:
    import hashlib

    data = b"damaged or not, it goes"
    cid = hashlib.sha256(data).hexdigest()
    store.put_chunk(cid, data)
    where = store.quarantine_chunk(cid, "checksum mismatch in a test")
    assert where and cid in where
    assert cid not in store.list_chunks()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        store.read_chunk(cid, len(data))
