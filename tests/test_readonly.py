"""Read-only run folders, and readers that race a pruner (issue 23 §7).

Read-only is real: a tmpfs remounted ``ro`` (which even root cannot write), a read-only bind
mount of a run a live training writes through its writable path, and a folder ``0555`` with
files ``0444`` read by a process that runs without the capabilities that let root ignore
permissions (``setpriv --bounding-set=-dac_override,...``: a root without them is refused like
any other user of a folder it may not write).

Pruned while read is real too: the reader (the CLI, ``unbroken.verify``/``load``, a restore) runs
in its own process, is frozen with SIGSTOP while it holds a file of the checkpoint open (seen in
``/proc/<pid>/fd``), a real training process commits a new checkpoint and its retention deletes the
old ones, then the reader is SIGCONTed. Each checkpoint holds two large tensor files read one
after the other (``UNBROKEN_READERS=1``, no mmap), so a reader frozen in the first one still has
the second to open, after it was deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import unbroken
from unbroken.cli import app
from unbroken.errors import StorageError

from conftest import real_pid

runner = CliRunner()
PY = sys.executable
BIG = 6 * 1024 * 1024  # float32 elements per tensor file of a "large" checkpoint (24 MB)
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
ATTEMPTS = 8


# ----------------------------------------------------------------------------- helpers
def make_run(run: Path, big_at: int | None = None, steps: tuple[int, ...] = (2, 4, 6)) -> None:
    """A run with checkpoints at ``steps``, metrics in its index; the one at ``big_at`` large."""
    with unbroken.Checkpointer(run, keep_last=None, preemption=None) as ck:
        for step in steps:
            n = BIG if step == big_at else 4
            ck.progress.step = step - 1
            ck.step({"a": torch.zeros(n), "b": torch.ones(n)}, loss=float(step))
            ck.save({"a": torch.zeros(n), "b": torch.ones(n)})


@contextlib.contextmanager
def mounted(where: Path, source: Path | None = None, copy: Path | None = None, size: str = "64m") -> Iterator[Path]:
    """A read-only mount at ``where``: a bind mount of ``source``, or a tmpfs holding ``copy``."""
    where.mkdir()
    if source is not None:
        subprocess.run(["mount", "--bind", str(source), str(where)], check=True)
    else:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
        if copy is not None:
            shutil.copytree(copy, where / copy.name, symlinks=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro" if source else "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` with its size and mtime (to prove nothing was written)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "UNBROKEN_READERS": "1", "UNBROKEN_NO_MMAP": "1", "UNBROKEN_PROGRESS": "0", **extra}


def freeze_while_reading(proc: subprocess.Popen[str], file: Path) -> bool:
    """SIGSTOP ``proc`` while it has ``file`` open; False if it exited before opening it."""
    target = str(file)
    while proc.poll() is None:
        pid = real_pid(proc)  # the process itself, when the suite's zygote forked it
        fds = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        for fd in names:
            try:
                if os.readlink(f"{fds}/{fd}") == target:
                    os.kill(pid, signal.SIGSTOP)
                    return True
            except OSError:
                continue
    return False


TRAIN_ON = textwrap.dedent("""
    import sys, torch, unbroken
    # a live training run commits step 8; its retention (keep_last=1) deletes every older checkpoint
    with unbroken.Checkpointer(sys.argv[1], keep_last=1, preemption=None) as ck:
        ck.start_fresh()  # it stands for the training that went on: it writes without resuming, on purpose
        ck.progress.step = 8
        ck.save({"a": torch.zeros(4), "b": torch.ones(4)})
""")


def race(tmp_path: Path, reader: list[str], run: Path, frozen_in: str, writer_run: Path | None = None,
         big_at: int = 2, make: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``reader``, freeze it while it reads ``run/frozen_in/t00-a.safetensors``, let a training
    process commit step 8 and prune everything older, then let the reader finish. Retried (with a
    fresh run) when the reader finished before it could be caught reading."""
    writer_run = writer_run or run
    for _ in range(ATTEMPTS):
        if make:
            shutil.rmtree(writer_run, ignore_errors=True)
            make_run(writer_run, big_at)
        proc = subprocess.Popen(reader, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        try:
            if not freeze_while_reading(proc, run / frozen_in / "t00-a.safetensors"):
                out, err = proc.communicate()
                if proc.returncode != 0:  # failed before reading the checkpoint: not a timing miss
                    return subprocess.CompletedProcess(reader, proc.returncode, out, err)
                continue  # finished before it could be caught: again
            pruned = subprocess.run([PY, "-c", TRAIN_ON, str(writer_run)], capture_output=True, text=True)
            assert pruned.returncode == 0, pruned.stderr
            assert not (writer_run / frozen_in).exists()
            os.kill(proc.pid, signal.SIGCONT)
            out, err = proc.communicate(timeout=300)
            return subprocess.CompletedProcess(reader, proc.returncode, out, err)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
    pytest.fail(f"could not catch the reader while it read {frozen_in} in {ATTEMPTS} attempts")


# ------------------------------------------------------------------- read-only folders
@pytest.mark.parametrize("bare", [False, True], ids=["with-index-and-lock", "copied-without-index-or-lock"])
def test_cli_reads_a_run_on_a_readonly_filesystem(tmp_path: Path, bare: bool) -> None:
    src = tmp_path / "run"
    make_run(src)
    if bare:
        for p in [*src.glob("index.sqlite*"), src / ".lock"]:
            p.unlink()
    with mounted(tmp_path / "ro", copy=src) as mnt:
        run = mnt / "run"
        before = tree(run)
        for args in (["ls", str(run)], ["ls", "--verify", str(run)], ["verify", str(run)],
                     ["verify", str(run / "step-000000004")], ["inspect", str(run / "step-000000004")],
                     ["events", str(run)]):
            r = cli(*args)
            assert r.exit_code == 0, (args, r.output, r.exception)
        assert cli("events", str(run), "--json").output.count('"kind": "saved"') == (0 if bare else 3)
        r = cli("metrics", str(run), "loss")
        if bare:  # no index: a message, not a traceback
            assert r.exit_code == 1 and "no metric was logged" in r.output, r.output
        else:
            assert r.exit_code == 0 and r.output.split("\n")[:3] == ["2\t2.0\t1", "4\t4.0\t1", "6\t6.0\t1"], r.output
            r = cli("plot", str(run), "--output", str(tmp_path / "loss.png"))
            assert r.exit_code == 0 and (tmp_path / "loss.png").stat().st_size > 0, r.output
        for args in (["prune", str(run), "--keep-last", "1"], ["tag", str(run / "step-000000004"), "best"]):
            r = cli(*args)
            assert r.exit_code == 1, (args, r.output)
            assert "ReadOnlyRunError: cannot" in r.output and str(run) in r.output, r.output
            assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        assert tree(run) == before


@pytest.mark.parametrize("bare", [False, True], ids=["with-index-and-lock", "copied-without-index-or-lock"])
def test_restore_from_a_readonly_filesystem_reads_and_the_first_save_raises(tmp_path: Path, bare: bool,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "run"
    make_run(src)
    (src / "step-000000006" / "t01-b.safetensors").write_bytes(b"damaged")  # the newest is invalid
    if bare:
        for p in [*src.glob("index.sqlite*"), src / ".lock"]:
            p.unlink()
    with mounted(tmp_path / "ro", copy=src) as mnt:
        run = mnt / "run"
        before = tree(run)
        state = {"a": torch.full((4,), 7.0), "b": torch.zeros(4)}
        ck = unbroken.Checkpointer(run, save_every=1, keep_last=1)
        try:
            info = ck.restore(state)
            assert info is not None and info.name == "step-000000004"  # the invalid newest skipped, left in place
            assert torch.equal(state["a"], torch.zeros(4)) and torch.equal(state["b"], torch.ones(4))
            assert "the run is read-only" in caplog.text and "left in place" in caplog.text
            for attempt, what in ((lambda: ck.step(state), "train and save into"),  # the first step, not a save later
                                  (lambda: ck.save(state), "save a checkpoint to"), (ck.prune, "prune"),
                                  (lambda: ck.tag("best", "step-000000004"), "tag")):
                with pytest.raises(StorageError, match=f"cannot {what} .*run.*cannot be written") as e:
                    attempt()
                assert type(e.value).__name__ == "ReadOnlyRunError"
        finally:
            ck.close()
        assert unbroken.load(run)["a"].numel() == 4  # the read-only load of a run (newest valid)
        assert unbroken.verify(run / "step-000000004").step == 4
        assert tree(run) == before


NO_DAC_SCRIPT = textwrap.dedent("""
    import json, sys, logging, torch, unbroken
    from typer.testing import CliRunner
    from unbroken.cli import app
    run = sys.argv[1]
    out = {}
    for name, args in [("ls", ["ls", "--verify", run]), ("verify", ["verify", run]), ("events", ["events", run]),
                       ("metrics", ["metrics", run, "loss"]), ("prune", ["prune", run, "--keep-last", "1"])]:
        r = CliRunner().invoke(app, args)
        out[name] = [r.exit_code, r.output, repr(r.exception) if r.exception and not isinstance(r.exception, SystemExit) else ""]
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    ck = unbroken.Checkpointer(run, keep_last=1, preemption=None)
    out["restored"] = ck.restore(state).name
    try:
        ck.save(state)
        out["save"] = "saved"
    except Exception as e:
        out["save"] = type(e).__name__ + ": " + str(e)
    ck.close()
    print(json.dumps(out))
""")  # noqa: E501 - the script's text, as it runs


def test_readonly_folder_for_a_user_who_may_not_write_it(tmp_path: Path) -> None:
    """Folders 0555, files 0444, read by a process without the capabilities that let root write anyway."""
    run = tmp_path / "run"
    make_run(run)
    for p in [run, *run.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    before = tree(run)
    try:
        r = subprocess.run([*NO_DAC, PY, "-c", NO_DAC_SCRIPT, str(run)], capture_output=True, text=True, env=env())
    finally:
        for p in [run, *run.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("ls", "verify", "events", "metrics"):
        assert out[name][0] == 0 and not out[name][2], (name, out[name])
    assert out["prune"][0] == 1 and "ReadOnlyRunError: cannot prune" in out["prune"][1], out["prune"]
    assert out["restored"] == "step-000000006"
    assert out["save"].startswith("ReadOnlyRunError: cannot save a checkpoint to")
    assert "Permission denied" in out["save"]
    assert tree(run) == before


def test_readonly_index_with_a_write_ahead_log_left_by_a_killed_writer(tmp_path: Path) -> None:
    """A writer killed with its index open leaves index.sqlite-wal (and -shm); copied without the -shm
    onto a read-only filesystem, the rows only the WAL holds are still shown."""
    run = tmp_path / "run"
    make_run(run)
    code = textwrap.dedent("""
        import os, sys
        from unbroken.run.index.index import RunIndex
        index = RunIndex(sys.argv[1])
        index._conn.execute("PRAGMA wal_autocheckpoint=0")
        index.event("only_in_the_wal", "written, then the process died")
        os.kill(os.getpid(), 9)
    """)
    subprocess.run([PY, "-c", code, str(run)], env=env())
    assert (run / "index.sqlite-wal").stat().st_size > 0
    (run / "index.sqlite-shm").unlink()
    with mounted(tmp_path / "ro", copy=run) as mnt:
        before = tree(mnt / "run")
        r = cli("events", str(mnt / "run"), "--kind", "only_in_the_wal", "--json")
        assert r.exit_code == 0, r.output
        assert [e["message"] for e in json.loads(r.output)["events"]] == ["written, then the process died"]
        assert tree(mnt / "run") == before


def test_readonly_index_that_cannot_be_opened_is_rebuilt_in_memory(tmp_path: Path) -> None:
    """Not even a copy can be read (the file is unreadable to this process): the index shown is
    rebuilt from the manifests, with a warning, never a sqlite traceback."""
    run = tmp_path / "run"
    make_run(run)
    (run / "index.sqlite").chmod(0)
    try:
        r = subprocess.run([*NO_DAC, PY, "-m", "unbroken.cli", "events", str(run)], capture_output=True, text=True,
                           env=env())
    finally:
        (run / "index.sqlite").chmod(0o644)
    assert r.returncode == 0, r.stderr
    assert "index_rebuilt" in r.stdout and "Traceback" not in r.stderr
    with sqlite3.connect(run / "index.sqlite") as db:  # untouched
        assert db.execute("SELECT count(*) FROM events WHERE kind = 'saved'").fetchone()[0] == 3


# --------------------------------------------------------- readers that race a pruner
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_cli_verify_of_a_run_reports_checkpoints_pruned_meanwhile(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = race(tmp_path, [PY, "-m", "unbroken.cli", "verify", str(run)], run, "step-000000002", big_at=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BAD" not in r.stdout and "gone" in r.stdout and "pruned" in r.stdout, r.stdout
    assert "pruned meanwhile" in r.stdout.splitlines()[-1], r.stdout


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_cli_verify_json_of_one_checkpoint_pruned_meanwhile(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = race(tmp_path, [PY, "-m", "unbroken.cli", "verify", "--json", str(run / "step-000000004")], run,
             "step-000000004", big_at=4)
    assert r.returncode == 1, r.stdout + r.stderr  # it no longer exists
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["checkpoints"][0]["pruned"] is True and doc["checkpoints"][0]["error"] is None


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_cli_ls_verify_reports_pruned_not_corrupt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = race(tmp_path, [PY, "-m", "unbroken.cli", "ls", "--verify", "--json", str(run)], run, "step-000000006",
             big_at=6)
    assert r.returncode == 0, r.stdout + r.stderr
    statuses = {c["name"]: c["status"] for c in json.loads(r.stdout)["checkpoints"]}
    assert "corrupt" not in statuses.values(), statuses
    assert statuses["step-000000004"] == statuses["step-000000002"] == "pruned", statuses


VERIFY_ONE = textwrap.dedent("""
    import sys, unbroken
    try:
        unbroken.verify(sys.argv[1])
        print("verified")
    except Exception as e:
        print(type(e).__name__, isinstance(e, unbroken.CorruptCheckpointError), e)
""")


def test_api_verify_raises_vanished_not_corrupt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = race(tmp_path, [PY, "-c", VERIFY_ONE, str(run / "step-000000004")], run, "step-000000004", big_at=4)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("CheckpointVanishedError True "), r.stdout  # still a CorruptCheckpointError
    assert "not damaged" in r.stdout


LOAD_RUN = textwrap.dedent("""
    import sys, unbroken
    tree = unbroken.load(sys.argv[1])
    print(tree["__unbroken__"]["progress"]["step"], tree["a"].numel())
""")


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_load_of_a_run_whose_newest_is_pruned_meanwhile_loads_the_new_newest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = race(tmp_path, [PY, "-c", LOAD_RUN, str(run)], run, "step-000000006", big_at=6)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["8", "4"], r.stdout
    assert "invalid" not in r.stderr, r.stderr


RESTORE = textwrap.dedent("""
    import sys, torch, unbroken
    state = {"a": torch.full((4,), 7.0), "b": torch.zeros(4)}
    ck = unbroken.Checkpointer(sys.argv[1], keep_last=None, preemption=None)
    info = ck.restore(state)
    print(info.name if info else None, state["a"].numel())
    ck.close()
""")


def test_readonly_restore_beside_a_live_training_that_prunes(tmp_path: Path) -> None:
    """The reader sees the run through a read-only bind mount; the training writes it through the
    writable path and prunes the checkpoint being restored: the restore takes the new newest, not an
    older one (pruned too) nor a fresh start."""
    rw = tmp_path / "run"
    make_run(rw, big_at=6)
    with mounted(tmp_path / "ro", source=rw) as ro:
        r = race(tmp_path, [PY, "-c", RESTORE, str(ro)], ro, "step-000000006", writer_run=rw, make=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["step-000000008", "4"], r.stdout + r.stderr[-2000:]
    assert "invalid" not in r.stderr and "the run is read-only" in r.stderr, r.stderr


DELETE_AND_RESTORE = textwrap.dedent("""
    import sys, torch, unbroken
    state = {"a": torch.full((4,), 7.0), "b": torch.zeros(4)}
    ck = unbroken.Checkpointer(sys.argv[1], keep_last=None, preemption=None)
    info = ck.restore(state)
    print(info.name if info else None)
    ck.close()
""")


def test_restore_does_not_report_or_quarantine_a_checkpoint_deleted_while_read(tmp_path: Path) -> None:
    """A writable run: the restoring process holds the lock, and the newest checkpoint is deleted
    under it (by hand, or by a process that ignores the lock). Not damage: no corruption event, no
    quarantine; the previous checkpoint is restored."""
    run = tmp_path / "run"
    for _ in range(ATTEMPTS):
        shutil.rmtree(run, ignore_errors=True)
        make_run(run, big_at=6)
        proc = subprocess.Popen([PY, "-c", DELETE_AND_RESTORE, str(run)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env())
        try:
            if not freeze_while_reading(proc, run / "step-000000006" / "t00-a.safetensors"):
                out, err = proc.communicate()
                assert proc.returncode == 0, err[-3000:]
                continue
            os.rename(run / "step-000000006", run / ".trash-by-hand")  # as the store deletes: rename, then remove
            shutil.rmtree(run / ".trash-by-hand")
            os.kill(proc.pid, signal.SIGCONT)
            out, err = proc.communicate(timeout=300)
            break
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
    else:
        pytest.fail("could not catch the restore while it read step-000000006")
    assert proc.returncode == 0, err[-3000:]
    assert out.split() == ["step-000000004"], out + err
    assert "invalid" not in err, err
    assert not (run / "quarantine").exists()
    with sqlite3.connect(run / "index.sqlite") as db:
        kinds = [k for (k,) in db.execute("SELECT kind FROM events")]
    assert "corruption_found" not in kinds and "quarantined" not in kinds, kinds


BECOMES_READONLY = textwrap.dedent("""
    import os, sys, torch, unbroken
    run = sys.argv[1]
    ck = unbroken.Checkpointer(run, keep_last=2, preemption=None)
    state = {"a": torch.zeros(4), "b": torch.ones(4)}
    ck.restore(state)
    ck.save(state)
    os.chmod(run, 0o555)  # the folder stops being writable under a running training
    for save in (lambda: ck.save(state), lambda: unbroken.save(os.path.join(run, "extra"), state)):
        try:
            save()
            print("saved")
        except Exception as e:
            print(type(e).__name__, isinstance(e, unbroken.StorageError), e)
    ck.close()
""")


def test_a_run_folder_that_stops_being_writable_fails_saves_with_a_storage_error(tmp_path: Path) -> None:
    """Writable when the training began (it holds the lock), then not: the save, and a save with
    ``unbroken.save`` into the folder, raise ReadOnlyRunError (a StorageError), never a raw OSError."""
    run = tmp_path / "run"
    try:
        r = subprocess.run([*NO_DAC, PY, "-c", BECOMES_READONLY, str(run)], capture_output=True, text=True, env=env())
    finally:
        if run.exists():
            run.chmod(0o755)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("ReadOnlyRunError True ") for line in lines), r.stdout
    assert all("Permission denied" in line for line in lines), r.stdout
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-000000000"]


RANKS = textwrap.dedent("""
    import os, sys, torch, unbroken
    rank, world = unbroken.init_distributed("gloo")
    ck = unbroken.Checkpointer(sys.argv[1], keep_last=1, preemption=None)
    state = {"a": torch.full((4,), 7.0), "b": torch.zeros(4)}
    info = ck.restore(state)
    print(f"rank {rank} restored {info.name} {float(state['b'].sum())}", flush=True)
    try:
        ck.save(state)
        print(f"rank {rank} saved", flush=True)
    except unbroken.StorageError as e:
        print(f"rank {rank} {type(e).__name__}", flush=True)
    ck.close()
    torch.distributed.destroy_process_group()
""")


@pytest.mark.slow
def test_readonly_restore_with_two_ranks_under_torchrun(tmp_path: Path) -> None:
    """Both ranks restore (the coordinator found the run read-only and told the others), and both
    raise at the save, before any collective: no rank waits for another that gave up."""
    src = tmp_path / "run"
    make_run(src)
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    with mounted(tmp_path / "ro", copy=src) as mnt:
        r = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                            str(mnt / "run")], capture_output=True, text=True, timeout=300,
                           env={**env(), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} restored step-000000006 4.0" in r.stdout, r.stdout + r.stderr[-2000:]
        assert f"rank {rank} ReadOnlyRunError" in r.stdout, r.stdout + r.stderr[-2000:]
