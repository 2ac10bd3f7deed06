"""The traps a new user falls into (issue 13), each reproduced: the state is checked at restore,
iterators started before a restore refuse to serve stale batches, a read-only restore works
beside a running writer, the console says what happened, and unbroken imports without fcntl."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import unbroken
from unbroken.errors import NoCheckpointError, RunLockedError, UnsupportedStateError


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# ------------------------------------------------------------------ the state is checked at restore
def test_a_plain_dataloader_is_refused_at_restore_with_the_fix(tmp_path: Path) -> None:
    model, opt = _model()
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)
    ckpt = unbroken.Checkpointer(tmp_path / "run")
    before = model.weight.clone()
    with pytest.raises(UnsupportedStateError) as e:
        ckpt.restore({"model": model, "optimizer": opt, "data": loader})
    text = str(e.value)
    assert 'state["data"] is a plain torch DataLoader' in text and "shuffle order" in text
    assert "ResumableLoader" in text and "allow_unsaved=['data']" in text
    assert torch.equal(model.weight, before)
    assert not (tmp_path / "run").exists(), "a refused restore must not create or lock the run"
    ckpt.close()


def test_an_unshuffled_dataloader_is_refused_too(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    with unbroken.Checkpointer(tmp_path / "run") as ckpt, pytest.raises(UnsupportedStateError) as e:
        ckpt.restore({"data": loader})
    assert "position in the epoch cannot be saved" in str(e.value) and "shuffle order" not in str(e.value)


def test_every_problem_is_reported_at_once_before_training(tmp_path: Path) -> None:
    """A sampler, an iterator and an unsupported object deep in the tree: one error at restore names
    all three (before this, each surfaced at the first save, one per run)."""
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    state = {"sampler": RandomSampler(range(10)), "it": iter(loader), "config": {"hook": lambda x: x}}
    with unbroken.Checkpointer(tmp_path / "run") as ckpt, pytest.raises(UnsupportedStateError) as e:
        ckpt.restore(state)
    text = str(e.value)
    assert text.startswith("3 objects in the state cannot be checkpointed")
    assert "RandomSampler sampler without state_dict()" in text
    assert 'state["it"] is an iterator' in text and "create the iterator after restore()" in text
    assert 'state["config"]["hook"] is a builtins.function' in text


def test_the_same_check_runs_at_the_first_save_without_restore(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2, shuffle=True)
    with unbroken.Checkpointer(tmp_path / "run") as ckpt, pytest.raises(UnsupportedStateError, match="ResumableLoader"):
        ckpt.save({"data": loader})


def test_stateful_loaders_pass(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = TensorDataset(torch.randn(8, 4))
    model, opt = _model()
    state = {"model": model, "optimizer": opt, "a": unbroken.data.ResumableLoader(data, 2),
             "b": StatefulDataLoader(data, batch_size=2, shuffle=True)}
    with unbroken.Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.restore(state) is None
        assert ckpt.save(state) is not None


def test_allow_unsaved_leaves_the_key_out_knowingly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _model()
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)
    state = {"model": model, "optimizer": opt, "data": loader}
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        with unbroken.Checkpointer(tmp_path / "run", allow_unsaved=["data"]) as ckpt:
            ckpt.restore(state)
            info = ckpt.save(state)
    assert any("not saved (allow_unsaved): state['data']" in r.getMessage() for r in caplog.records)
    assert info is not None and "data" not in unbroken.load(info.path)
    model2, opt2 = _model()
    state2 = {"model": model2, "optimizer": opt2, "data": loader}
    with unbroken.Checkpointer(tmp_path / "run", allow_unsaved=["data"]) as ckpt:
        assert ckpt.restore(state2) is not None
    assert state2["data"] is loader
    with pytest.raises(TypeError, match="list of state keys"):
        unbroken.Checkpointer(tmp_path / "run", allow_unsaved="data")  # type: ignore[arg-type]


# ------------------------------------------------------------------ iterators and restore
def _order_run(tmp_path: Path, started_before: bool, created_before: bool) -> list[int]:
    data = TensorDataset(torch.arange(24))
    loader = unbroken.data.ResumableLoader(data, batch_size=4, shuffle=True, seed=3)
    with unbroken.Checkpointer(tmp_path / "run", save_every=2) as ckpt:
        state = {"data": loader}
        ckpt.restore(state)
        for i, _ in enumerate(loader):
            ckpt.step(state)
            if i == 2:
                break  # the checkpoint at step 2 is the one restored below
    loader = unbroken.data.ResumableLoader(data, batch_size=4, shuffle=True, seed=3)
    it = iter(loader) if created_before else None
    if started_before:
        assert it is not None
        next(it)
    with unbroken.Checkpointer(tmp_path / "run", save_every=2) as ckpt:
        ckpt.restore({"data": loader})
        return [int(x) for (batch,) in (it if it is not None else loader) for x in batch]


def test_an_iterator_started_before_restore_refuses_to_serve_the_old_order(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="started before restore"):
        _order_run(tmp_path, started_before=True, created_before=True)


def test_an_iterator_created_but_not_started_before_restore_serves_the_resumed_order(tmp_path: Path) -> None:
    ref = unbroken.data.ResumableLoader(TensorDataset(torch.arange(24)), batch_size=4, shuffle=True, seed=3)
    expected = [int(x) for (batch,) in ref for x in batch][8:]  # the checkpoint at step 2: 8 samples seen
    assert _order_run(tmp_path / "a", started_before=False, created_before=True) == expected
    assert _order_run(tmp_path / "b", started_before=False, created_before=False) == expected


# ------------------------------------------------------------------ read-only restore
def _run_with_three(tmp_path: Path) -> tuple[unbroken.Checkpointer, dict, Path]:
    model, opt = _model()
    ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=1, keep_last=None)
    state = {"model": model, "optimizer": opt}
    ckpt.restore(state)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        ckpt.step(state)
    return ckpt, state, tmp_path / "run"


_WRITER = textwrap.dedent("""
    import sys, torch, unbroken
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    with unbroken.Checkpointer(sys.argv[1], save_every=1, keep_last=None) as ckpt:
        ckpt.restore(state)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            ckpt.step(state)
        ckpt.tag("best", "step-000000001")
        print("ready", flush=True)
        sys.stdin.readline()  # holds the run until the test is done
""")


def test_read_only_restore_of_a_run_beside_its_writer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        with pytest.raises(RunLockedError):  # the writer holds the run ...
            unbroken.Checkpointer(run).restore({})
        model, opt = _model()
        unbroken.load(run, {"model": model, "optimizer": opt})  # ... and a reader still gets the newest
        newest = unbroken.load(run / "step-000000003")
        assert torch.equal(model.weight, newest["model"]["weight"])
        first = unbroken.load(run / "step-000000001")["model"]["weight"]
        assert not torch.equal(first, newest["model"]["weight"])
        model2, _ = _model()
        unbroken.load(run, {"model": model2}, strict=False, tag="best")
        assert torch.equal(model2.weight, first)
        with pytest.raises(NoCheckpointError, match="tagged 'nope'"):
            unbroken.load(run, {"model": model2}, strict=False, tag="nope")
    finally:
        writer.communicate("done\n", timeout=60)
    assert writer.returncode == 0


def test_read_only_restore_falls_back_past_a_corrupt_one_and_moves_nothing(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    writer, state, run = _run_with_three(tmp_path)
    writer.close()
    second = unbroken.load(run / "step-000000002")["model"]["weight"]
    tensor_file = next((run / "step-000000003").glob("*model*.safetensors"))
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0x01
    tensor_file.write_bytes(bytes(data))
    before = _listing(run)
    model, _ = _model()
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        unbroken.load(run, {"model": model}, strict=False)
    assert torch.equal(model.weight, second)
    assert any("skipping an invalid checkpoint" in r.getMessage() and "checksum mismatch" in r.getMessage()
               for r in caplog.records)
    assert _listing(run) == before, "a read-only restore must not quarantine or write anything"
    for folder in run.glob("step-*"):
        for f in folder.glob("*.safetensors"):
            f.write_bytes(b"garbage")
    with pytest.raises(NoCheckpointError, match="3 failed verification"):
        unbroken.load(run, {"model": model}, strict=False)


# ------------------------------------------------------------------ console feedback, portability
_SCRIPT = textwrap.dedent("""
    import logging, os, sys, torch, unbroken
    if os.environ.get("SILENCE") == "1":
        logging.getLogger("unbroken").setLevel(logging.WARNING)
    if os.environ.get("HF_STYLE_LOGGING") == "1":  # as transformers' example scripts (run_clm.py) configure it
        logging.basicConfig(format="%(name)s %(levelname)s %(message)s", handlers=[logging.StreamHandler(sys.stdout)])
    model = torch.nn.Linear(2, 1)
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with unbroken.Checkpointer(sys.argv[1], save_every=2) as ckpt:
        ckpt.restore(state)
        for _ in range(4):
            ckpt.step(state)
""")


def _console(run: Path, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(run)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    return out.stderr


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_one_line_per_save_and_resume_on_stderr_silenceable(tmp_path: Path) -> None:
    err = _console(tmp_path / "run")
    lines = err.splitlines()
    assert lines[0].startswith("unbroken: no checkpoint in") and "starting from scratch" in lines[0]
    assert [ln.split(" to ")[0] for ln in lines[1:]] == ["unbroken: saved step 2", "unbroken: saved step 4"]
    err = _console(tmp_path / "run")
    assert err.splitlines()[0].startswith("unbroken: resumed from ") and "(step 4)" in err
    assert _console(tmp_path / "run", UNBROKEN_QUIET="1") == ""
    assert _console(tmp_path / "run", SILENCE="1") == ""


def test_where_a_run_resumed_from_is_shown_whatever_the_script_s_logging(tmp_path: Path) -> None:
    """A script that configures logging for itself at WARNING (the HF example scripts: the root logger,
    to stdout) drops unbroken's INFO lines, its choice; but not whether the run resumed, and from where:
    that line goes through the script's own handler. Silenced only on purpose."""
    def run(**env: str) -> str:
        out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "run")], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "HF_STYLE_LOGGING": "1", **env})
        assert out.returncode == 0, out.stderr
        assert "unbroken:" not in out.stderr  # unbroken added no handler of its own
        return out.stdout

    first = run().splitlines()
    assert len(first) == 1 and first[0].startswith("unbroken INFO no checkpoint in"), first  # no "saved" lines
    second = run().splitlines()
    assert len(second) == 1 and second[0].startswith("unbroken INFO resumed from ") and "(step 4)" in second[0], second
    assert run(UNBROKEN_QUIET="1") == ""
    assert run(SILENCE="1") == ""


def test_imports_and_saves_without_fcntl(tmp_path: Path) -> None:
    """macOS/Windows portability: the library must not need fcntl (blocked here, as on Windows)."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["fcntl"] = None  # import fcntl now raises ImportError
        import torch, unbroken
        m = torch.nn.Linear(2, 1)
        unbroken.save({str(tmp_path / "ck")!r}, {{"m": m}})
        print(sorted(unbroken.load({str(tmp_path / "ck")!r})["m"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['bias', 'weight']"


# ------------------------------------------------------------------ metrics that survive a SIGKILL
_TRAINER = textwrap.dedent("""
    import os, signal, sys, torch, unbroken
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = unbroken.data.ResumableLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), 4)
    state = {"model": model, "optimizer": opt, "data": data}
    kill_at = int(sys.argv[2])
    with unbroken.Checkpointer(sys.argv[1], save_every=5, keep_last=None) as ckpt:
        ckpt.restore(state)
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            ckpt.step(state, loss=loss)
            if ckpt.progress.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt.progress.step == 16:
                break
""")


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_metric_rows_up_to_a_checkpoint_survive_a_sigkill_and_check_finds_a_lost_one(tmp_path: Path) -> None:
    """SIGKILL at step 13 (checkpoints at 5 and 10): the rows of steps 1-10 are durable with the
    checkpoint at 10; the resumed run re-logs 11-16 bitwise; `metrics --check` passes. A row of a
    covered step deleted from the index (what a lost buffer looked like) makes it fail, naming it."""
    import sqlite3

    from unbroken.run.index.index import RunIndex

    run = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", _TRAINER, str(run), "13"], capture_output=True, timeout=120,
                            env={**os.environ, "UNBROKEN_QUIET": "1"})
    assert killed.returncode == -9, killed.stderr
    with RunIndex(run, readonly=True) as idx:
        assert {s for s, _, _ in idx.metric("loss")} >= set(range(1, 11))
    done = subprocess.run([sys.executable, "-c", _TRAINER, str(run), "0"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "UNBROKEN_QUIET": "1"})
    assert done.returncode == 0, done.stderr
    with RunIndex(run, readonly=True) as idx:
        report = idx.continuity("loss")
        assert report.ok and report.missing == [] and report.disagreeing == []
        assert {s for s, _, _ in idx.metric("loss")} == set(range(1, 17))

    def check() -> tuple[int, dict]:
        out = subprocess.run([str(Path(sys.executable).parent / "unbroken"), "metrics", str(run), "loss", "--check",
                              "--json"], capture_output=True, text=True, timeout=120)
        return out.returncode, json.loads(out.stdout)

    # Rows 11-13 may or may not have reached the index before the kill: with them the re-run
    # steps are compared (ok, exit 0); without them nothing was logged twice (not checked, exit 1).
    rc, report = check()
    assert report["missing"] == [] and report["disagreeing"] == [], report
    assert (rc, report["verdict"]) == ((0, "continuous") if report["compared"] else (1, "not checked")), report
    with sqlite3.connect(run / "index.sqlite") as conn:  # lose the row of step 7 (covered by step-000000010)
        conn.execute("DELETE FROM metrics WHERE step = 7 AND name = 'loss'")
    with RunIndex(run, readonly=True) as idx:
        assert idx.continuity("loss").missing == [7]
    rc, report = check()
    assert rc == 1 and report["missing"] == [7] and not report["ok"], report
