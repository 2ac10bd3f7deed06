"""One writer per run, whatever happens to the lock: every spelling of a location shares one lock,
an error while locking leaks nothing, a deleted or replaced lock stops the writer before its next
commit, a dropped Checkpointer releases its lease at exit, and an empty location is refused.

Real components only: writers in real subprocesses, a real full filesystem (a small tmpfs the
test mounts), the real SeaweedFS S3 server of ``conftest.py``. Where an S3 error must arrive at
one exact moment, a store subclass fails on command (as DESIGN.md's fault tests do)."""

from __future__ import annotations

import errno
import gc
import json
import threading
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import RunLockedError, StorageError
from unbroken.store import open_store
from unbroken.store.lease import LEASE_FILE, LeaseLock
from unbroken.store.local import LocalStore
from unbroken.store.s3 import S3Store

from conftest import real_pid

CLI = [sys.executable, "-m", "unbroken.cli"]

# A writer in its own process: takes the run's lock, then obeys one command a line on stdin.
WRITER = textwrap.dedent("""
    import sys, torch, unbroken
    from unbroken.errors import RunLockedError
    ckpt = unbroken.Checkpointer(sys.argv[1], preemption=None, keep_last=None)
    ckpt.restore({"w": torch.zeros(2)})
    print("locked", flush=True)
    for line in sys.stdin:
        try:
            info = ckpt.save({"w": torch.ones(2)})
            print("saved", info.name, flush=True)
        except RunLockedError as e:
            print("refused", str(e).replace("\\n", " "), flush=True)
""")


def start_writer(location: str, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, location], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def ask_to_save(proc: subprocess.Popen) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("save\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


# ------------------------------------------------------------------ every spelling, one lock
def spellings(tmp_path: Path) -> dict[str, str]:
    """Every way to name the run ``tmp_path/real/run`` (with ``tmp_path`` the working folder)."""
    run = tmp_path / "real" / "run"
    return {"path": str(run), "relative": "real/run", "dotdot": "./real/../real/run/", "slash": f"{run}/",
            "file": f"file://{run}", "file-localhost": f"file://localhost{run}", "local": f"local://{run}",
            "symlinked-parent": str(tmp_path / "link" / "run"), "file-symlinked": f"file://{tmp_path}/link/run/"}


@pytest.fixture()
def named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    (tmp_path / "real" / "run").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    return spellings(tmp_path)


@pytest.mark.parametrize("holder", ["path", "local", "file-symlinked"])
def test_every_spelling_of_a_run_folder_shares_one_lock(named: dict[str, str], holder: str) -> None:
    writer = start_writer(named[holder])
    try:
        for location in named.values():
            ckpt = unbroken.Checkpointer(location, preemption=None)
            with pytest.raises(RunLockedError, match=rf"another process \(host \S+ pid {real_pid(writer)}\)"):
                ckpt.restore({"w": torch.zeros(2)})
            ckpt.close()
        # the maintenance CLI through another spelling is refused too (it would prune beside the training)
        res = subprocess.run([*CLI, "prune", named["local"], "--keep-last", "1"], capture_output=True, text=True)
        assert res.returncode == 1 and "being written by another process" in res.stdout + res.stderr
    finally:
        stop(writer)
    assert not (Path(named["path"]) / LEASE_FILE).exists()


def test_every_spelling_opens_the_same_store(named: dict[str, str], tmp_path: Path) -> None:
    real = os.path.realpath(tmp_path / "real" / "run")
    for what, location in named.items():
        store = open_store(location)
        assert isinstance(store, LocalStore), what
        assert store.identity == real, what
        assert os.path.isabs(store.url) and os.path.realpath(store.url) == real, what
        assert os.path.realpath(store.local_dir()) == real, what  # where the index is kept


def test_the_remote_tier_must_be_another_location_in_any_spelling(named: dict[str, str], tmp_path: Path) -> None:
    for location in named.values():
        with pytest.raises(StorageError, match="remote tier must be another location"):
            unbroken.Checkpointer(named["path"], remote=unbroken.Remote(location), preemption=None)
    assert list((tmp_path / "real" / "run").iterdir()) == []


def test_a_file_url_naming_another_host_or_a_relative_path_is_refused(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for url in (f"file://otherhost{tmp_path}/run", "file://run", "local://run"):
        with pytest.raises(StorageError, match="file:///"):
            unbroken.Checkpointer(url, preemption=None)
    assert list(tmp_path.iterdir()) == []


def test_s3_spellings_share_one_lease_and_one_cache(s3, s3_url) -> None:
    a = open_store(s3_url, s3.storage_options)
    b = open_store(s3_url.replace("s3://", "s3a://") + "/", s3.storage_options)
    first, second = LeaseLock(a), LeaseLock(b)
    first.acquire()
    try:
        second.acquire()  # the same process: shared (reference-counted), not "held by another process"
        second.release()
    finally:
        first.release()
    assert not a.fs.exists(a.path(LEASE_FILE))
    assert a.identity == b.identity and a.local_dir() == b.local_dir()


# ------------------------------------------------------------------ an error while locking
@pytest.fixture()
def full_disk(tmp_path: Path):
    """A 4 MiB tmpfs holding ``run/`` and a file that fills the rest; unmounted at the end."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "run").mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"x" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_while_locking_leaks_no_lock(full_disk: Path) -> None:
    run = full_disk / "run"
    ckpt = unbroken.Checkpointer(run, preemption=None)
    with pytest.raises(OSError) as failed:
        ckpt.restore({"w": torch.zeros(2)})
    ckpt.close()
    (full_disk / "filler").unlink()  # space again: this process, and any other, can take the lock
    other = start_writer(str(run))
    stop(other)
    with unbroken.Checkpointer(run, preemption=None) as again:
        assert again.save({"w": torch.ones(2)}).step == 0
    assert isinstance(failed.value, StorageError)  # a library error that says what to do
    assert re.search("(?i)no space left.*free some space", str(failed.value))


class _LostResponse(S3Store):
    """S3 whose next lease PUT is carried out but whose answer is lost (``lose``), or whose second
    lease PUT is refused (``refuse``): a connection that drops, a policy that denies."""

    mode = ""
    puts = 0

    def s3(self, what, method, **kwargs):
        if method == "put_object" and "IfNoneMatch" in kwargs and _LostResponse.mode:
            _LostResponse.puts += 1
            if _LostResponse.mode == "lose" and _LostResponse.puts == 1:
                def lost():
                    self.fs.call_s3(method, **kwargs)
                    raise ConnectionResetError("the connection dropped before the answer arrived")
                return self.call(what, lost)
            if _LostResponse.mode == "refuse" and _LostResponse.puts == 2:
                raise PermissionError("AccessDenied: not allowed by the bucket policy")
        return super().s3(what, method, **kwargs)


def _faulty(s3, s3_url, mode: str) -> S3Store:
    plain = open_store(s3_url, s3.storage_options)
    _LostResponse.mode, _LostResponse.puts = mode, 0
    return _LostResponse(plain.fs, plain.root, plain.url)


def test_a_lease_whose_answer_was_lost_is_ours(s3, s3_url) -> None:
    store = _faulty(s3, s3_url, "lose")
    lease = LeaseLock(store)
    lease.acquire()  # the retried PUT finds the lease it wrote itself: ours, not "another process"
    try:
        assert json.loads(store.fs.cat_file(store.path(LEASE_FILE)))["pid"] == os.getpid()
        lease.verify()
    finally:
        lease.release()
    assert not store.fs.exists(store.path(LEASE_FILE))


def test_an_error_after_the_lease_was_written_leaves_no_lease(s3, s3_url) -> None:
    store = _faulty(s3, s3_url, "refuse")
    with pytest.raises(PermissionError):
        LeaseLock(store).acquire()
    assert not store.fs.exists(store.path(LEASE_FILE))
    _LostResponse.mode = ""
    lease = LeaseLock(store)
    lease.acquire()  # at once: not refused by this very process's leftover
    lease.release()


# ------------------------------------------------------------------ a deleted or replaced lock
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_writer_whose_lock_file_was_removed_refuses_to_commit(tmp_path: Path, how: str) -> None:
    run = tmp_path / "run"
    first = start_writer(str(run))
    try:
        assert ask_to_save(first) == "saved step-000000000"
        if how == "deleted":
            (run / ".lock").unlink()
        else:
            (tmp_path / "other").write_text("someone else's file\n")
            os.replace(tmp_path / "other", run / ".lock")
        second = start_writer(str(run))  # the lock at the path is free: a second writer gets in
        try:
            answer = ask_to_save(first)
            assert answer.startswith("refused") and ".lock" in answer and "another writer" in answer
            saved = ask_to_save(second).split()
            assert saved[0] == "saved"
            assert ask_to_save(first).startswith("refused")  # and it stays stopped
        finally:
            stop(second)
    finally:
        stop(first)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == sorted(["step-000000000",
                                                                                           saved[1]])


def _wait_until_stopped(proc: subprocess.Popen) -> None:
    """Until ``proc`` has stopped itself (SIGSTOP at a fault point: state T in /proc)."""
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert proc.poll() is None
        time.sleep(0.05)


def test_a_lock_removed_while_a_save_is_being_written_stops_its_commit(tmp_path: Path) -> None:
    """The lock is checked again right before the commit: a save takes time, and the lock can be
    deleted and taken by a second writer while its files are written."""
    run = tmp_path / "run"
    first = start_writer(str(run), UNBROKEN_FAULTS="save.mid_file=1", UNBROKEN_FAULT_ACTION="stop")
    try:
        assert first.stdin is not None
        first.stdin.write("save\n")
        first.stdin.flush()
        _wait_until_stopped(first)  # half-way through a tensor file, its lock checked already
        (run / ".lock").unlink()
        second = start_writer(str(run))
        try:
            first.send_signal(signal.SIGCONT)
            assert first.stdout is not None
            answer = first.stdout.readline().strip()
            assert answer.startswith("refused") and "was replaced" in answer and "another writer" in answer
            assert ask_to_save(second).startswith("saved")
        finally:
            stop(second)
    finally:
        stop(first)
    assert len([p for p in run.iterdir() if p.name.startswith("step-")]) == 1  # the second writer's
    assert not [p for p in run.iterdir() if p.name.startswith(".staging")]


def test_a_writer_whose_lock_file_was_removed_deletes_and_tags_nothing(tmp_path: Path) -> None:
    from unbroken.run.scheduling import Schedule

    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, preemption=None, keep_last=None)
    try:
        for step in range(3):
            ckpt.progress.step = step
            ckpt.save({"w": torch.zeros(2)})
        (run / ".lock").unlink()
        with pytest.raises(RunLockedError, match="was deleted"):
            ckpt.run.prune(Schedule(None, None, 1, None), None)
        with pytest.raises(RunLockedError, match="was deleted"):
            ckpt.tag("best", "step-000000000")
        assert len(ckpt.checkpoints()) == 3 and not (run / "tags.json").exists()
    finally:
        ckpt.close()


def test_a_writer_whose_lease_was_deleted_refuses_to_commit(s3, s3_url) -> None:
    ckpt = unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None, keep_last=None)
    try:
        ckpt.save({"w": torch.zeros(2)})
        store = ckpt.run.store
        store.fs.rm(store.path(LEASE_FILE))
        with pytest.raises(RunLockedError, match="lease .* gone"):
            ckpt.save({"w": torch.ones(2)})
        assert [c.step for c in ckpt.checkpoints()] == [0]
    finally:
        ckpt.close()


# ------------------------------------------------------------------ a Checkpointer never closed
DROPPER = textwrap.dedent("""
    import gc, json, sys, weakref, torch, unbroken
    ckpt = unbroken.Checkpointer(sys.argv[1], storage_options=json.loads(sys.argv[2]), preemption=None)
    ckpt.save({"w": torch.zeros(2)})
    gone = weakref.ref(ckpt)
    del ckpt
    gc.collect()
    print("collected" if gone() is None else "alive", flush=True)
""")


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_dropped_checkpointer_releases_its_lease_at_exit(s3, s3_url) -> None:
    # the dropper runs under another host name: its leftover lease could only expire (2 min)
    res = subprocess.run(["unshare", "--uts", "sh", "-c", 'hostname dropper-node && exec "$@"', "sh",
                          sys.executable, "-c", DROPPER, s3_url, json.dumps(s3.storage_options)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "collected"
    store = open_store(s3_url, s3.storage_options)
    assert not store.fs.exists(store.path(LEASE_FILE)), store.fs.cat_file(store.path(LEASE_FILE))
    lease = LeaseLock(store, ttl_s=600)
    lease.acquire()  # at once
    lease.release()


EXITER = textwrap.dedent("""
    import json, logging, sys
    from unbroken.store import open_store
    from unbroken.store.lease import LeaseLock
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # every retry of a request is logged
    LeaseLock(open_store(sys.argv[1], json.loads(sys.argv[2]))).acquire()
    print("acquired", flush=True)
""")


def test_the_lease_is_deleted_at_exit_while_the_s3_client_still_works(s3, s3_url) -> None:
    """A lease still held at a normal exit is deleted by a threading exit hook: by ``atexit`` time
    the thread pools the S3 client resolves addresses on are shut down, and the delete failed and
    was retried until its deadline (every such exit took 30-60 s)."""
    res = subprocess.run([sys.executable, "-c", EXITER, s3_url, json.dumps(s3.storage_options)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "acquired", res.stderr
    assert "failed (attempt" not in res.stderr, res.stderr
    store = open_store(s3_url, s3.storage_options)
    assert not store.fs.exists(store.path(LEASE_FILE))


def test_a_dropped_holder_releases_its_share_when_collected(s3, s3_url, tmp_path: Path) -> None:
    store = open_store(s3_url, s3.storage_options)
    LeaseLock(store).acquire()  # dropped at once, never released
    gc.collect()
    for thread in threading.enumerate():  # the lease is deleted in a thread of its own
        if thread.name == "unbroken-lease-release":
            thread.join()
    assert not store.fs.exists(store.path(LEASE_FILE))
    run = tmp_path / "run"
    open_store(str(run)).lock().acquire()
    gc.collect()
    for thread in threading.enumerate():
        if thread.name == "unbroken-lock-release":
            thread.join()
    stop(start_writer(str(run)))  # another process gets the folder's lock


# ------------------------------------------------------------------ no location
@pytest.mark.parametrize("location", ["", "   ", None, "file://", "local://", "\t\n"])
def test_an_empty_location_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         location) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match="(?i)no run location"):
        unbroken.Checkpointer(location, preemption=None)
    with pytest.raises(StorageError, match="(?i)no run location"):
        unbroken.save(location, {"w": torch.zeros(2)})
    with pytest.raises(StorageError, match="(?i)no run location"):
        unbroken.Checkpointer(tmp_path / "run", remote=unbroken.Remote(location), preemption=None)
    res = subprocess.run([*CLI, "ls", location or ""], capture_output=True, text=True)
    assert res.returncode != 0 and "no run location" in (res.stdout + res.stderr).lower()
    assert list(tmp_path.iterdir()) == []


HOLDER = """
import sys, torch, unbroken
ck = unbroken.Checkpointer(sys.argv[1], preemption=None)
ck.restore({"w": torch.zeros(2)})
print("holding", flush=True)
sys.stdin.read()
ck.close()
"""

OTHER_USER = """
import sys, torch, unbroken
ck = unbroken.Checkpointer(sys.argv[1], save_every=1, preemption=None)
state = {"w": torch.zeros(2)}
try:
    info = ck.restore(state)
    print("restored", info.step, flush=True)
    ck.step(state)
    print("stepped", flush=True)
except unbroken.UnbrokenError as e:
    print(type(e).__name__, e, flush=True)
"""


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_lock_file_another_user_owns_still_keeps_its_live_writer_exclusive(tmp_path: Path) -> None:
    """A shared run folder whose ``.lock`` belongs to a teammate (0644, another uid): a process that
    cannot write it is refused while the teammate's writer lives (the flock is taken through a
    read-only descriptor), not opened "read-only" beside it; once the writer is gone it opens the
    run read-only, restores, and its first step raises instead of training for nothing."""
    import subprocess
    import sys

    import torch

    run = tmp_path / "run"
    first = unbroken.Checkpointer(run, preemption=None)
    first.save({"w": torch.ones(2)})
    first.close()
    os.chmod(run, 0o777)
    os.chown(run / ".lock", 54321, 54321)  # a teammate's lock file: not writable by this user
    no_dac = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        r = subprocess.run([*no_dac, sys.executable, "-c", OTHER_USER, str(run)], capture_output=True, text=True,
                           timeout=120)
        assert r.stdout.startswith("RunLockedError") and "being written by another process" in r.stdout, \
            r.stdout + r.stderr
    finally:
        holder.communicate("", timeout=60)
    r = subprocess.run([*no_dac, sys.executable, "-c", OTHER_USER, str(run)], capture_output=True, text=True,
                       timeout=120)
    lines = r.stdout.splitlines()
    assert lines[0] == "restored 0" and lines[1].startswith("ReadOnlyRunError cannot train and save into"), r.stdout
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-000000000"]
