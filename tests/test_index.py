"""The run index (``unbroken.run.index.index.RunIndex``): every method round-trips; it matches the
manifests written by a real ``Checkpointer``; it is rebuilt when deleted or damaged; two
reader processes and a writer process share it; a writer SIGKILLed at random moments leaves
a database that opens and, after ``rebuild()``, matches the manifests again."""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken
from unbroken.checkpoint.discovery import discover
from unbroken.run.index.index import INDEX_FILE, RunIndex
from unbroken.checkpoint.reader import read_manifest
from unbroken.store.local import LocalStore as LocalStorage

SRC = str(Path(unbroken.__file__).resolve().parents[1])


def bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def row_args(name: str, step: int, seq: int, kind: str = "regular", **over):
    return {"name": name, "step": step, "seq": seq, "epoch": step // 10, "created": 1000.0 + seq,
            "duration_s": 0.25, "size_bytes": 100 + step, "kind": kind, "metrics": {"loss": 1.0 / (step + 1)},
            "tags": ["t"], "environment": {"host": "h", "world_size": 1}, **over}


def manifest_view(run: Path) -> dict[str, tuple]:
    """What the manifests of the committed checkpoints say (listed by the Checkpointer's ``discover``)."""
    storage, out = LocalStorage(run), {}
    for c in discover(storage):
        m = read_manifest(storage, c.name)
        out[c.name] = (m.step, m.seq, m.created, m.total_bytes, m.kind, m.metrics, m.progress.get("epoch"),
                       m.environment)
    return out


def index_view(idx: RunIndex, status: str = "committed") -> dict[str, tuple]:
    return {r["name"]: (r["step"], r["seq"], r["created"], r["size_bytes"], r["kind"], r["metrics"], r["epoch"],
                        r["environment"]) for r in idx.checkpoints(status)}


def make_run(run: Path, saves: int = 5, keep_last: int | None = 3) -> unbroken.Checkpointer:
    """A run with real checkpoints of a few tensors; kinds, epochs and metrics vary."""
    torch.manual_seed(0)
    state = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.float64), "meta": {"lr": 0.1}}
    ckpt = unbroken.Checkpointer(run, keep_last=keep_last, preemption=None)
    for i in range(saves):
        ckpt.progress.epoch = i // 2
        ckpt.step(state, loss=torch.tensor(1.0 / (i + 1)))
        ckpt.save(state, kind="emergency" if i == saves - 1 else "regular")
    ckpt.close()
    for f in run.glob("index.sqlite*"):  # the Checkpointer keeps an index; these tests build their own
        f.unlink()
    return ckpt


def py(code: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# ------------------------------------------------------------------ round trips

def test_every_method_round_trips(tmp_path):
    run = tmp_path / "run"
    idx = RunIndex(run)
    assert (run / INDEX_FILE).is_file()
    assert [e["kind"] for e in idx.events()] == ["index_rebuilt"]
    assert idx.events()[0]["data"] == {"reason": "missing", "committed": 0, "quarantined": 0, "unreadable": []}
    assert idx.checkpoints() == [] and idx.segments() == [] and idx.metric("loss") == []

    with pytest.raises(RuntimeError, match="start_segment"):
        idx.log_metrics(1, {"loss": 1.0})
    seg = idx.start_segment(None, 0)
    assert seg == idx.segment
    (s,) = idx.segments()
    assert s["id"] == seg and s["resumed_from"] is None and s["start_step"] == 0 and s["pid"] == os.getpid()
    assert idx.events("run_started")[0]["segment"] == seg

    values = [1.5, float("nan"), float("inf"), -0.0, 3, np.float32(0.1), torch.tensor(2.5, dtype=torch.float64)]
    for step, v in enumerate(values, 1):
        idx.log_metrics(step, {"loss": v})
    got = idx.metric("loss")
    assert [(st, sg) for st, _, sg in got] == [(i, seg) for i in range(1, 8)]
    assert [bits(v) for _, v, _ in got] == [bits(float(v)) for v in values]
    with pytest.raises(TypeError):
        idx.log_metrics(9, {"loss": "1.0"})
    with pytest.raises(TypeError):
        idx.log_metrics(9, {"loss": torch.ones(2)})

    a = row_args("step-000000010", 10, 0)
    b = row_args("step-000000020", 20, 1, kind="emergency", tags=["best", "x"])
    c = row_args("step-000000015", 15, 2, kind="preemption")
    for r in (a, b, c):
        idx.record_checkpoint(**r)
    rows = idx.checkpoints()
    assert [r["name"] for r in rows] == ["step-000000015", "step-000000020", "step-000000010"]  # by seq
    for r, want in zip(rows, (c, b, a), strict=True):
        assert r == {**want, "status": "committed", "segment": seg}
    assert [e["kind"] for e in idx.events() if e["checkpoint"]] == ["saved", "emergency_save", "saved"]
    assert idx.events("emergency_save")[0]["data"] == {"kind": "emergency", "seq": 1, "size_bytes": 120}

    idx.set_status("step-000000010", "pruned", "retention")
    idx.set_status("step-000000020", "quarantined", "checksum mismatch")
    idx.set_status("step-000000077", "quarantined", "never indexed")  # unknown: a row from its name
    assert [r["name"] for r in idx.checkpoints("committed")] == ["step-000000015"]
    assert [r["name"] for r in idx.checkpoints("pruned")] == ["step-000000010"]
    q = {r["name"]: r for r in idx.checkpoints("quarantined")}
    assert q["step-000000077"]["step"] == 77 and q["step-000000077"]["seq"] is None
    assert [(e["checkpoint"], e["message"], e["step"]) for e in idx.events("quarantined")] == [
        ("step-000000020", "checksum mismatch", 20), ("step-000000077", "never indexed", 77)]
    with pytest.raises(ValueError):
        idx.set_status("step-000000015", "deleted")
    with pytest.raises(ValueError):
        idx.record_checkpoint(**row_args("x", 1, 9, status="weird"))

    eid = idx.event("preempted", "SIGTERM", step=15, checkpoint="step-000000015", data={"signal": 15, "nan": "nan"})
    (e,) = idx.events("preempted")
    assert e["id"] == eid and e["message"] == "SIGTERM" and e["data"] == {"signal": 15, "nan": "nan"}
    assert e["segment"] == seg and e["time"] == pytest.approx(time.time(), abs=60)
    before = (idx.checkpoints(), idx.events(), idx.segments(), idx.metric("loss"))
    idx.close()
    idx.close()  # idempotent

    again = RunIndex(run)  # everything persisted
    after = (again.checkpoints(), again.events(), again.segments(), again.metric("loss"))
    assert [bits(v) for _, v, _ in after[3]] == [bits(v) for _, v, _ in before[3]]
    assert after[:3] == before[:3] and len(after[0]) == 4
    seg2 = again.start_segment("step-000000015", 15)
    assert seg2 == seg + 1
    assert again.events("resumed")[0]["checkpoint"] == "step-000000015"
    assert [s["resumed_from"] for s in again.segments()] == [None, "step-000000015"]
    again.close()
    with pytest.raises(RuntimeError, match="closed"):
        again.event("x")


def test_metrics_are_batched_and_durable_at_each_checkpoint(tmp_path):
    run = tmp_path / "run"
    idx = RunIndex(run, flush_every=4, flush_seconds=3600)
    idx.start_segment(None, 0)
    other = sqlite3.connect(run / INDEX_FILE)  # another connection: sees only what is committed

    def committed() -> int:
        return other.execute("SELECT count(*) FROM metrics").fetchone()[0]

    idx.log_metrics(1, {"a": 1.0, "b": 2.0})
    idx.log_metrics(2, {"a": 1.0})
    assert committed() == 0
    idx.log_metrics(3, {"a": 1.0})  # 4 pending: a batch
    assert committed() == 4
    idx.log_metrics(4, {"a": 1.0})
    assert committed() == 4
    idx.record_checkpoint(**row_args("step-000000004", 4, 0))
    assert committed() == 5
    idx.log_metrics(5, {"a": 1.0})
    idx.close()
    assert committed() == 6
    idx = RunIndex(run, flush_every=1000, flush_seconds=0.0)  # time-based: every call is due
    idx.start_segment("step-000000004", 4)
    idx.log_metrics(5, {"a": 1.0})
    assert committed() == 7
    idx.close()
    other.close()


def test_continuity_passes_for_identical_values_and_names_different_ones(tmp_path):
    idx = RunIndex(tmp_path / "run")
    s1 = idx.start_segment(None, 0)
    curve = {step: 1.0 / step for step in range(1, 11)}
    curve[4] = float("nan")
    for step in range(1, 9):  # killed after step 8, last checkpoint at step 5
        idx.log_metrics(step, {"loss": curve[step], "lr": 0.1})
    s2 = idx.start_segment("step-000000005", 5)
    for step in range(6, 11):  # an exact resume re-logs identical values (nan included)
        idx.log_metrics(step, {"loss": curve[step], "lr": 0.1})
    report = idx.continuity("loss")
    assert report.ok and report.checked == [6, 7, 8] and report.disagreeing == []

    s3 = idx.start_segment("step-000000003", 3)
    for step in range(4, 8):
        value = curve[step] + (1e-12 if step == 6 else 0.0)  # one step differs in the last bits
        idx.log_metrics(step, {"loss": value, "lr": 0.1 if step != 7 else -0.0})
    report = idx.continuity("loss")
    assert not report.ok
    assert report.checked == [4, 5, 6, 7, 8] and report.disagreeing == [6]
    assert report.values[6] == [(s1, curve[6]), (s2, curve[6]), (s3, curve[6] + 1e-12)]
    lr = idx.continuity("lr")
    assert lr.disagreeing == [7]
    idx.log_metrics(9, {"x": 0.0})
    s4 = idx.start_segment("step-000000008", 8)
    idx.log_metrics(9, {"x": -0.0})  # bitwise: 0.0 and -0.0 differ
    assert idx.continuity("x").disagreeing == [9] and s4 == s3 + 1
    assert idx.continuity("nothing").ok
    idx.close()


# ------------------------------------------------------- against real manifests

def test_index_matches_the_manifests_of_real_checkpointer_saves(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    state = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.float64), "meta": {"lr": 0.1}}
    ckpt = unbroken.Checkpointer(run, keep_last=3, preemption=None)
    for i in range(7):  # the Checkpointer records segments, metrics, saves and prunes itself
        ckpt.progress.epoch = i // 3
        ckpt.step(state, loss=torch.tensor(0.5 / (i + 1)))
        ckpt.save(state, kind="emergency" if i == 4 else "regular")
    idx = ckpt._core.recorder.index
    assert idx is not None
    idx.flush()
    assert index_view(idx) == manifest_view(run)
    assert [r["name"] for r in idx.checkpoints("committed")] == [c.name for c in ckpt.checkpoints()]
    assert [r["kind"] for r in idx.checkpoints("committed")] == ["regular", "regular", "emergency"]
    assert len(idx.checkpoints("pruned")) == 4 and len(idx.events("pruned")) == 4

    idx.rebuild()
    assert index_view(idx) == manifest_view(run)
    assert [r["name"] for r in idx.checkpoints("committed")] == [c.name for c in ckpt.checkpoints()]
    rows = {r["name"]: r for r in idx.checkpoints()}
    newest = ckpt.checkpoints()[0]
    assert rows[newest.name]["tags"] == [] and rows[newest.name]["duration_s"] > 0  # kept
    assert rows[newest.name]["segment"] == idx.segment and rows[newest.name]["kind"] == "regular"
    assert rows[newest.name]["environment"]["torch"] == torch.__version__  # from the manifest
    assert len(idx.checkpoints("pruned")) == 4  # history of deleted checkpoints is kept
    assert idx.events("index_rebuilt")[-1]["data"]["reason"] == "requested"
    assert len(idx.metric("loss")) == 7 and len(idx.events("saved")) == 6  # history survives a rebuild
    assert len(idx.events("emergency_save")) == 1

    # deleted without the index being told (a kill between delete and set_status): kept as pruned
    vanished = ckpt.checkpoints()[-1].name
    shutil.rmtree(run / vanished)
    idx.rebuild()
    assert index_view(idx) == manifest_view(run) and vanished not in index_view(idx)
    assert vanished in {r["name"] for r in idx.checkpoints("pruned")}

    # damage the newest: restore quarantines it; plant a quarantined folder with garbage
    (run / newest.name / "manifest.json").write_text("{ not json")
    ckpt.close()
    ckpt = unbroken.Checkpointer(run, keep_last=3, preemption=None)
    ckpt.restore(state)
    ckpt.close()
    idx = RunIndex(run)
    (run / "quarantine" / "step-000000099").mkdir()
    (run / "quarantine" / "step-000000099" / "manifest.json").write_bytes(b"\x00garbage")
    idx.rebuild()
    assert index_view(idx) == manifest_view(run)
    q = {r["name"]: r for r in idx.checkpoints("quarantined")}
    assert set(q) == {newest.name, "step-000000099"}
    assert q["step-000000099"]["step"] == 99 and q["step-000000099"]["seq"] is None
    assert q[newest.name]["step"] == newest.step  # its manifest is unreadable too: from the name
    idx.close()


def test_rebuild_keeps_quarantined_manifests_and_skips_unreadable_committed_ones(tmp_path):
    run = tmp_path / "run"
    make_run(run, saves=4, keep_last=None)
    names = sorted(manifest_view(run))
    (run / "quarantine").mkdir()
    shutil.move(run / names[0], run / "quarantine" / names[0])  # intact, but quarantined
    (run / names[1] / "manifest.json").write_text("[]")  # committed but unreadable
    idx = RunIndex(run)  # created from the manifests
    assert index_view(idx) == manifest_view(run) and names[1] not in index_view(idx)
    (q,) = idx.checkpoints("quarantined")
    assert q["name"] == names[0] and q["seq"] == 0 and q["size_bytes"] > 0
    assert idx.events("index_rebuilt")[0]["data"]["unreadable"] == [names[1]]
    idx.close()


# ------------------------------------------------------------ missing / damaged

def test_rebuilt_after_the_file_is_deleted(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    idx = RunIndex(run)
    idx.start_segment(None, 0)
    idx.event("custom")
    wal = (run / f"{INDEX_FILE}-wal").read_bytes()
    idx.close()
    assert not (run / f"{INDEX_FILE}-wal").exists()
    (run / INDEX_FILE).unlink()
    (run / f"{INDEX_FILE}-wal").write_bytes(wal)  # a stale WAL of the deleted file must not come back
    idx = RunIndex(run)
    assert index_view(idx) == manifest_view(run) and len(manifest_view(run)) == 3
    assert [e["kind"] for e in idx.events()] == ["index_rebuilt"] and idx.segments() == []
    assert idx.events()[0]["data"]["reason"] == "missing"
    idx.close()


def test_planted_links_are_never_followed(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    make_run(run)
    other = RunIndex(outside)  # a valid index elsewhere, and a file a planted WAL link points to
    other.start_segment(None, 0)
    other.close()
    (outside / "victim").write_bytes(b"keep me")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    (run / INDEX_FILE).symlink_to(outside / INDEX_FILE)
    (run / f"{INDEX_FILE}-wal").symlink_to(outside / "victim")
    ro = RunIndex(run, readonly=True)
    assert ro.in_memory and index_view(ro) == manifest_view(run)
    ro.close()
    idx = RunIndex(run)
    idx.start_segment(None, 0)
    idx.record_checkpoint(**row_args("step-000000500", 500, 99))
    idx.close()
    assert not (run / INDEX_FILE).is_symlink() and not (run / f"{INDEX_FILE}-wal").is_symlink()
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    idx = RunIndex(run, readonly=True)
    assert not idx.in_memory and idx.checkpoints()[0]["name"] == "step-000000500"
    idx.close()


def _garbage(p: Path) -> None:
    p.write_bytes(random.Random(1).randbytes(8192))


def _truncated(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


def _header_only(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(40)


def _other_schema(p: Path) -> None:
    p.unlink()
    with sqlite3.connect(p) as c:
        c.execute("CREATE TABLE checkpoints (name TEXT, other INTEGER)")
        c.execute("INSERT INTO checkpoints VALUES ('x', 1)")
    c.close()


def _newer_version(p: Path) -> None:
    with sqlite3.connect(p) as c:
        c.execute("UPDATE schema_version SET version = 99")
    c.close()


@pytest.mark.parametrize("damage", [_garbage, _truncated, _header_only, _other_schema, _newer_version])
def test_rebuilt_after_the_file_is_damaged(tmp_path, caplog, damage):
    run = tmp_path / "run"
    make_run(run)
    idx = RunIndex(run)
    idx.start_segment(None, 0)
    for step in range(3000):  # enough pages for a truncation to cut the b-trees
        idx.log_metrics(step, {"loss": step * 0.5})
    idx.close()
    damage(run / INDEX_FILE)
    damaged = (run / INDEX_FILE).read_bytes()

    with caplog.at_level(logging.WARNING, logger="unbroken"):
        ro = RunIndex(run, readonly=True)  # readonly: never touches the file, uses an in-memory rebuild
    assert ro.in_memory and index_view(ro) == manifest_view(run)
    assert ro.events()[0]["data"]["reason"] == "corrupt" and "damaged" in caplog.text
    with pytest.raises(RuntimeError, match="readonly"):
        ro.rebuild()
    ro.close()
    assert (run / INDEX_FILE).read_bytes() == damaged and not list(run.glob("*.corrupt-*"))

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        idx = RunIndex(run)
    warned = [r for r in caplog.records if r.name == "unbroken" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "damaged" in warned[0].getMessage()
    (aside,) = run.glob(f"{INDEX_FILE}.corrupt-*")
    assert aside.read_bytes() == damaged
    assert index_view(idx) == manifest_view(run) and len(manifest_view(run)) == 3
    assert [e["kind"] for e in idx.events()] == ["index_rebuilt"]
    assert idx.events()[0]["data"]["reason"] == "corrupt" and idx.metric("loss") == []
    idx.close()
    check = sqlite3.connect(run / INDEX_FILE)
    assert check.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    assert check.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    check.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        RunIndex(run).close()  # healthy now: no warning, nothing moved
    assert not caplog.records and len(list(run.glob("*.corrupt-*"))) == 1


def test_an_empty_file_is_initialized_without_a_warning(tmp_path, caplog):
    run = tmp_path / "run"
    make_run(run)
    (run / INDEX_FILE).write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        idx = RunIndex(run)
    assert not caplog.records and index_view(idx) == manifest_view(run)
    idx.close()


def test_readonly_never_writes(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    ro = RunIndex(run, readonly=True)  # missing: an in-memory rebuild, no file created
    assert ro.in_memory and index_view(ro) == manifest_view(run)
    assert not (run / INDEX_FILE).exists() and ro.events()[0]["data"]["reason"] == "missing"
    for call in (lambda: ro.start_segment(None, 0), lambda: ro.event("x"), ro.rebuild,
                 lambda: ro.set_status("a", "pruned"), lambda: ro.record_checkpoint(**row_args("a", 1, 1))):
        with pytest.raises(RuntimeError, match="readonly"):
            call()
    ro.close()

    w = RunIndex(run)
    w.start_segment(None, 0)
    w.log_metrics(1, {"loss": 0.5})
    w.flush()
    ro = RunIndex(run, readonly=True)  # sees committed data while the writer is open
    assert not ro.in_memory and index_view(ro) == manifest_view(run) and ro.metric("loss") == [(1, 0.5, 1)]
    w.record_checkpoint(**row_args("step-000000777", 777, 50))
    assert ro.checkpoints()[0]["name"] == "step-000000777"
    with pytest.raises(RuntimeError, match="log_metrics"):
        ro.log_metrics(1, {"x": 1.0})
    ro.close()
    w.close()


# ---------------------------------------------------------------- processes

READER = """
    import sys, time
    from pathlib import Path
    from unbroken.run.index.index import RunIndex
    run, me, reopen = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    idx = RunIndex(run, readonly=True)
    assert not idx.in_memory
    (run / f"ready-{me}").touch()
    last, seen, loops = (-1, -1), set(), 0
    while True:
        done = (run / "done").exists()
        if reopen:
            idx.close()
            idx = RunIndex(run, readonly=True)
            assert not idx.in_memory
        now = (len(idx.checkpoints()), len(idx.metric("loss")))
        assert now[0] >= last[0] and now[1] >= last[1], (last, now)
        assert len(idx.events("saved")) >= now[0]
        last, loops = now, loops + 1
        seen.add(now)
        if done:
            break
        time.sleep(0.001)  # leave the CPU to the writer
    print(last[0], last[1], len(seen), loops)
"""


def test_two_readers_and_a_writer_in_separate_processes(tmp_path):
    run = tmp_path / "run"
    RunIndex(run).close()
    readers = [py(READER, str(run), str(i), str(i)) for i in (0, 1)]  # reader 1 reopens every time
    deadline = time.monotonic() + 60
    while not all((run / f"ready-{i}").exists() for i in (0, 1)):
        assert time.monotonic() < deadline and all(r.poll() is None for r in readers), readers[0].stderr.read()
        time.sleep(0.01)
    idx = RunIndex(run, flush_every=7)  # the writer: this process
    idx.start_segment(None, 0)
    for step in range(1, 301):
        idx.log_metrics(step, {"loss": 1.0 / step})
        if step % 5 == 0:
            idx.record_checkpoint(**row_args(f"step-{step:09d}", step, step // 5))
        time.sleep(0.002)
    idx.close()
    (run / "done").touch()
    for r in readers:
        out, err = r.communicate(timeout=60)
        assert r.returncode == 0, err
        n_ckpt, n_metric, distinct, loops = map(int, out.split())
        assert (n_ckpt, n_metric) == (60, 300)
        assert distinct > 2 and loops >= distinct  # it did read while the writer wrote
    idx = RunIndex(run)
    assert len(idx.checkpoints()) == 60 and len(idx.metric("loss")) == 300
    idx.close()


KILLED = """
    import os, sys, time, torch, unbroken
    run, until, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    while not os.path.exists(go):  # started early, so that its imports overlap the previous trial
        time.sleep(0.005)
    torch.manual_seed(0)
    state = {"w": torch.zeros(4, 1)}  # plain tensors: torch.optim's first step costs seconds of imports
    ckpt = unbroken.Checkpointer(run, save_every=3, keep_last=2, preemption=None)
    # until > 0: resume from the oldest checkpoint (re-running logged steps), stop after `until` steps
    info = ckpt.restore(state, path=ckpt.checkpoints()[-1].path) if until else ckpt.restore(state)
    w = state["w"]
    first = True
    while not until or ckpt.progress.step < info.step + until:
        g = torch.Generator().manual_seed(ckpt.progress.step)
        x = torch.randn(8, 4, generator=g)
        err = x @ w - x.sum(1, keepdim=True) + 1e-3 * torch.randn(8, 1)  # global RNG: exact only if restored
        loss = (err ** 2).mean()
        w -= 0.02 * x.T @ err / 8
        saved = ckpt.step(state, loss=loss)  # the Checkpointer logs the metric and the save itself
        if saved and first:  # killed only after this process committed a checkpoint of its own
            print("ready", info.step if info else 0, flush=True)
            first = False
    ckpt.close()
"""


def check_after_kill(run: Path, caplog) -> None:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        idx = RunIndex(run)
    assert not caplog.records, "a killed writer must leave a healthy database"
    assert not list(run.glob("*.corrupt-*"))
    start = {s["id"]: s["start_step"] for s in idx.segments()}
    for row in idx.checkpoints():  # a recorded checkpoint made its segment's metrics up to it durable
        if row["segment"] is not None:
            logged = {step for step, _, seg in idx.metric("loss") if seg == row["segment"]}
            assert set(range(start[row["segment"]] + 1, row["step"] + 1)) <= logged, row["name"]
    idx.rebuild()
    assert index_view(idx) == manifest_view(run) and manifest_view(run)
    assert [r["name"] for r in idx.checkpoints("committed")] == [c.name for c in discover(LocalStorage(run))]
    assert idx.continuity("loss").ok
    idx.close()


def test_writer_killed_at_random_moments(tmp_path, caplog):
    rng = random.Random(7)
    run = tmp_path / "run"
    # two writers SIGKILLed at random moments (one batches metrics, one commits every one), then a
    # clean resume from the oldest checkpoint, which re-runs steps the second one logged
    args = ["0", "0", "6"]
    procs = [py(KILLED, str(run), until, str(tmp_path / f"go-{i}")) for i, until in enumerate(args)]
    try:
        for i, proc in enumerate(procs[:2]):
            (tmp_path / f"go-{i}").touch()
            assert proc.stdout is not None and proc.stdout.readline().startswith("ready"), proc.stderr.read()
            time.sleep(rng.uniform(0.05, 0.4))
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            assert proc.returncode == -signal.SIGKILL
            check_after_kill(run, caplog)
        (tmp_path / "go-2").touch()
        out, err = procs[2].communicate(timeout=120)
        assert procs[2].returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    oldest = int(out.split()[1])
    check_after_kill(run, caplog)
    idx = RunIndex(run, readonly=True)
    assert len(idx.segments()) == 3 and [e["checkpoint"] for e in idx.events("resumed")][-1] == f"step-{oldest:09d}"
    report = idx.continuity("loss")
    assert report.ok, report.values  # exact resumes re-log identical losses
    assert set(range(oldest + 1, oldest + 4)) <= set(report.checked)
    assert all(math.isfinite(v) for _, v, _ in idx.metric("loss"))
    idx.close()
