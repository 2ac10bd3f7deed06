"""Runs on a real S3 server (SeaweedFS, started by the tests): bad input, a server that dies in
the middle of an upload, the writer lease, credentials that never leak, the CLI on URLs."""

from __future__ import annotations

import json
import shutil
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import RunLockedError, StorageError
from unbroken.store import open_store
from unbroken.store.lease import LeaseLock
from unbroken.store.s3 import S3Store

from s3_server import ACCESS_KEY, SECRET_KEY


def multi_file_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": {"buf": torch.randn(300_000)}}


def params(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def bump(state: dict) -> None:
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1)


# ------------------------------------------------------------------ bad input
def test_unknown_scheme_is_an_error_never_a_local_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match="unknown storage scheme 'foo'"):
        unbroken.Checkpointer("foo://bucket/run")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_backend_names_the_extra_to_install() -> None:
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    with pytest.raises(StorageError, match=r"pip install -e '\.\[gcs\]' in unbroken's folder"):
        unbroken.Checkpointer("gs://bucket/run")


def test_a_bucket_that_does_not_exist_fails_before_training(s3) -> None:
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        unbroken.Checkpointer("s3://no-such-bucket-here/run", storage_options=s3.storage_options)


def test_wrong_credentials_fail_before_training(s3) -> None:
    opts = dict(s3.storage_options, secret="wrong-secret")
    with pytest.raises(StorageError, match="access denied.*credentials") as err:
        unbroken.Checkpointer(f"s3://{s3.new_prefix()}/run", storage_options=opts)
    assert "wrong-secret" not in str(err.value)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_an_unreachable_endpoint_fails_clearly(s3) -> None:
    opts = dict(s3.storage_options, endpoint_url="http://127.0.0.1:9")
    with pytest.raises(StorageError, match="cannot reach"):
        unbroken.Checkpointer("s3://bucket/run", storage_options=opts)


def test_botocore_retries_are_cut_so_that_a_request_deadline_holds(s3) -> None:
    """unbroken retries each request itself (its deadline, Remote.request_deadline_s); botocore's five
    retries with backoff inside each attempt would stretch it (6-7 s an attempt on a refused connection).
    A user's own botocore retries are kept."""
    store = open_store("s3://bucket/run", s3.storage_options)
    assert store.fs.config_kwargs["retries"]["total_max_attempts"] == 2  # (s3fs adds its mode)
    mine = dict(s3.storage_options, config_kwargs={"retries": {"mode": "adaptive", "total_max_attempts": 9}})
    store = open_store("s3://bucket/run", mine)
    assert store.fs.config_kwargs["retries"] == {"mode": "adaptive", "total_max_attempts": 9}
    remote = unbroken.Remote("s3://bucket/run", storage_options=s3.storage_options, request_deadline_s=7)
    assert remote.request_deadline_s == 7
    with pytest.raises(ValueError, match="request_deadline_s"):
        unbroken.Remote("s3://bucket/run", request_deadline_s=0)


# ------------------------------------------------------ a server that restarts
def _kill_server_during_second_file(monkeypatch, s3, down_s: float) -> threading.Thread:
    """Arm a fault: when the second data file of a save is opened, SIGKILL the server and
    start it again ``down_s`` later (same data, same ports)."""
    real = S3Store.open_writer
    opened = []
    restarted = threading.Thread(target=lambda: (time.sleep(down_s), s3.start()))

    def open_writer(self, path, staging):
        opened.append(path)
        if len(opened) == 2:
            s3.kill()
            restarted.start()
        return real(self, path, staging)

    monkeypatch.setattr(S3Store, "open_writer", open_writer)
    return restarted


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_server_restart_mid_upload_loses_nothing(s3, s3_url, monkeypatch) -> None:
    state = multi_file_state()
    ckpt = unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None, keep_last=None)
    ckpt.progress.step = 1
    first = params(state)
    ckpt.save(state)
    bump(state)
    restarted = _kill_server_during_second_file(monkeypatch, s3, down_s=3.0)
    ckpt.progress.step = 2
    info = ckpt.save(state)  # the uploads retry through the outage
    restarted.join()
    assert info.step == 2
    store = open_store(s3_url, s3.storage_options)
    assert store.list_committed() == ["step-000000001", "step-000000002"] and store.list_uncommitted() == []
    for name in store.list_committed():
        unbroken.verify(f"{s3_url}/{name}", storage_options=s3.storage_options)
    second = params(state)
    ckpt.close()
    fresh = multi_file_state()
    with unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None) as again:
        assert again.restore(fresh).step == 2
        assert all(torch.equal(second[k], v) for k, v in params(fresh).items())
        again.restore(fresh, path=f"{s3_url}/step-000000001")
        assert all(torch.equal(first[k], v) for k, v in params(fresh).items())


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_server_down_longer_than_the_retries_fails_the_save_cleanly(s3, s3_url, monkeypatch) -> None:
    state = multi_file_state()
    ckpt = unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None, keep_last=None)
    ckpt.run.store.retry = type(ckpt.run.store.retry)(deadline_s=4.0)
    ckpt.progress.step = 1
    ckpt.save(state)
    restarted = _kill_server_during_second_file(monkeypatch, s3, down_s=12.0)
    ckpt.progress.step = 2
    with pytest.raises(OSError):
        ckpt.save(state)
    restarted.join()
    store = open_store(s3_url, s3.storage_options)
    assert store.list_committed() == ["step-000000001"]  # no half checkpoint is committed
    monkeypatch.undo()
    ckpt.progress.step = 3
    assert ckpt.save(state).step == 3  # the next save succeeds
    assert store.list_committed() == ["step-000000001", "step-000000003"]
    unbroken.verify(f"{s3_url}/step-000000001", storage_options=s3.storage_options)
    ckpt.close()
    with unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None) as again:
        again.restore(multi_file_state())  # the leftover of step 2 is removed by the next writer
    assert store.list_uncommitted() == []


# --------------------------------------------------------------------- the lease
def test_the_lease_is_conditional_and_cannot_be_stolen(s3, s3_url) -> None:
    store = open_store(s3_url, s3.storage_options)
    a = LeaseLock(store)
    a.acquire()
    try:
        assert store.conditional is True  # SeaweedFS honours If-None-Match / If-Match
        doc = json.loads(store.fs.cat_file(store.path(".lock.json")))
        assert doc["pid"] == os.getpid() and doc["expires"] > time.time()
        other = open_store(s3_url, s3.storage_options)
        assert other.put_conditional(other.path(".lock.json"), b"{}") is None  # exists: refused
    finally:
        a.release()
    assert not store.fs.exists(store.path(".lock.json"))


def test_a_lease_taken_over_while_paused_is_lost_and_stops_commits(s3, s3_url) -> None:
    store = open_store(s3_url, s3.storage_options)
    lease = LeaseLock(store, ttl_s=1.5)
    lease.acquire()
    try:
        thief = json.dumps({"owner": "x", "host": "elsewhere", "pid": 1, "expires": time.time() + 3600})
        store.fs.pipe_file(store.path(".lock.json"), thief.encode())
        deadline = time.monotonic() + 10
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RunLockedError, match="taken over by host elsewhere"):
            lease.verify()
    finally:
        lease.release()
    assert store.fs.exists(store.path(".lock.json"))  # the new holder's lease is left alone


def test_an_expired_lease_of_another_host_is_taken_over(s3, s3_url) -> None:
    store = open_store(s3_url, s3.storage_options)
    dead = json.dumps({"owner": "x", "host": "gone-node", "pid": 1, "expires": time.time() - 1})
    store.fs.pipe_file(store.path(".lock.json"), dead.encode())
    lease = LeaseLock(store)
    lease.acquire()
    try:
        assert json.loads(store.fs.cat_file(store.path(".lock.json")))["pid"] == os.getpid()
    finally:
        lease.release()


def _other_host_lease(store, expires_in: float) -> bytes:
    return json.dumps({"owner": "y", "host": "other-node", "pid": 1, "expires": time.time() + expires_in}).encode()


def test_a_live_lease_of_another_host_is_waited_for_then_refused(s3, s3_url) -> None:
    """Another node's writer that keeps renewing: the newcomer waits for the expiry, sees the
    renewal, and is refused."""
    store = open_store(s3_url, s3.storage_options)
    stop = threading.Event()

    def renew() -> None:  # the other node's writer
        while not stop.is_set():
            store.fs.pipe_file(store.path(".lock.json"), _other_host_lease(store, 2.0))
            stop.wait(0.5)

    # the other node holds the lease before the newcomer looks (a renewer thread started alone raced
    # the newcomer's first read: it found no lease and took it, in a full run)
    store.fs.pipe_file(store.path(".lock.json"), _other_host_lease(store, 2.0))
    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RunLockedError, match="host other-node"):
            LeaseLock(store, ttl_s=2.0).acquire()
        assert time.monotonic() - t0 >= 0.4  # it waited for a renewal before refusing
    finally:
        stop.set()
        renewer.join()


def test_a_silent_lease_of_another_host_is_taken_over_after_it_expires(s3, s3_url) -> None:
    store = open_store(s3_url, s3.storage_options)
    silent = _other_host_lease(store, 1.5)
    store.fs.pipe_file(store.path(".lock.json"), silent)
    lease = LeaseLock(store, ttl_s=2.0)
    lease.acquire()
    try:
        mine = json.loads(store.fs.cat_file(store.path(".lock.json")))
        assert mine["pid"] == os.getpid()
        # taken over once it had expired, never before (whatever the machine's load: no time bound here)
        assert mine["acquired"] >= json.loads(silent)["expires"], mine
    finally:
        lease.release()


# ---------------------------------------------------------- no credentials leak
def test_credentials_are_never_written_anywhere(s3, s3_url, caplog, tmp_path) -> None:
    caplog.set_level(logging.DEBUG)
    state = multi_file_state()
    with unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None) as ckpt:
        ckpt.restore(state)
        ckpt.step(state, loss=1.0)
        ckpt.save(state, tag="best")
        ckpt.tag("again")
        infos = ckpt.checkpoints()
        local_dir = ckpt.run.store.local_dir()
    fs = s3.fs()
    blobs = [fs.cat_file(p) for p in fs.find(s3_url[len("s3://"):])]
    blobs += [p.read_bytes() for p in local_dir.rglob("*") if p.is_file()]
    assert blobs and infos
    for secret in (SECRET_KEY.encode(), ACCESS_KEY.encode()):
        assert not any(secret in b for b in blobs)
        assert not [r for r in caplog.records if r.name.startswith("unbroken") and secret.decode() in r.getMessage()]
        assert all(secret.decode() not in repr(i) for i in infos)


# ------------------------------------------------------------------------ the CLI
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_cli_lists_verifies_and_inspects_a_remote_run(s3, s3_url) -> None:
    state = multi_file_state()
    with unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None) as ckpt:
        for step in (1, 2):
            ckpt.progress.step = step
            ckpt.save(state)
    opts = [f"endpoint_url={s3.endpoint}", f"key={ACCESS_KEY}", f"secret={SECRET_KEY}"]
    base = [sys.executable, "-m", "unbroken.cli"] + [x for o in opts for x in ("-o", o)]
    env = dict(os.environ, COLUMNS="200")
    out = subprocess.run(base + ["list", s3_url], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "step-000000002" in out.stdout and "step-000000001" in out.stdout, out
    out = subprocess.run(base + ["verify", s3_url], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.count("ok") == 2, out
    out = subprocess.run(base + ["inspect", f"{s3_url}/step-000000002"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and "model/0.weight" in out.stdout, out
    # damage one object: verify says which, exit 1
    fs = s3.fs()
    victim = next(p for p in fs.find(s3_url[5:] + "/step-000000001") if p.endswith("t00-model.safetensors"))
    data = bytearray(fs.cat_file(victim))
    data[-1] ^= 1
    fs.pipe_file(victim, bytes(data))
    out = subprocess.run(base + ["verify", s3_url], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "BAD" in out.stdout and "checksum mismatch" in out.stdout, out
    out = subprocess.run(base + ["list", "s3://no-such-bucket-here/run"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 1 and "does not exist" in out.stderr and "Traceback" not in out.stderr, out


# --------------------------------------------------------------- the index
def test_the_index_of_a_remote_run_is_a_local_cache_rebuilt_from_the_manifests(s3, s3_url) -> None:
    from unbroken.run.index.index import RunIndex

    state = multi_file_state()
    with unbroken.Checkpointer(s3_url, storage_options=s3.storage_options, preemption=None) as ckpt:
        ckpt.restore(state)
        for _ in range(3):
            ckpt.step(state, loss=0.5)
            ckpt.save(state)
        cache = ckpt.run.store.local_dir()
    assert (cache / "index.sqlite").is_file() and (cache / "location.txt").read_text().strip() == s3_url
    with RunIndex(s3_url, storage_options=s3.storage_options, readonly=True) as idx:
        assert not idx.in_memory
        assert [r["name"] for r in idx.checkpoints("committed")] == ["step-000000003", "step-000000002",
                                                                       "step-000000001"]
        assert idx.events("saved") and idx.metric("loss")
    shutil.rmtree(cache)  # derived data: a new machine has none
    with RunIndex(s3_url, storage_options=s3.storage_options, readonly=True) as idx:
        assert idx.in_memory  # rebuilt from the remote manifests
        assert [r["step"] for r in idx.checkpoints("committed")] == [3, 2, 1]


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_test_server_moves_to_other_ports_when_one_is_taken_before_it_binds() -> None:
    """The suite's own S3 server: a port chosen free and taken by another process (another worker's server)
    before weed binds it once cost a whole worker its S3 tests; its first start now moves to other ports."""
    import socket

    from s3_server import RETRY, S3Server

    server = S3Server()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", server.ports["s3.port"]))
    squatter.listen(1)
    taken = server.ports["s3.port"]
    try:
        server.start()
        assert server.ports["s3.port"] != taken and RETRY in server.log_tail(400)
        server.fs().pipe(f"{server.new_bucket()}/x", b"ok")  # the server it started, not the squatter
    finally:
        squatter.close()
        server.cleanup()
