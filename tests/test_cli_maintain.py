"""``unbroken prune`` and ``unbroken tag`` on real runs, and their refusal while a trainer writes the run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_cli import as_json, invoke, make_state, snapshot, train

import unbroken
from unbroken.run.index.index import RunIndex

TESTS = Path(__file__).parent
HOLDER = """
import sys
sys.path.insert(0, sys.argv[2])
import unbroken
from test_cli import make_state
ckpt = unbroken.Checkpointer(sys.argv[1], keep_last=None, preemption=None)
ckpt.restore(make_state())  # takes the run's writer lock, as a training process does
print("holding", flush=True)
sys.stdin.readline()
ckpt.close()
"""


@contextmanager
def writer_process(run: Path) -> Iterator[None]:
    """Another process that has begun writing ``run`` (a Checkpointer after its restore), until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(TESTS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0


def steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("step-*"))


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    """Steps 2, 4, 6, 8, 10; the best (lowest) loss at step 6."""
    train(tmp_path / "run", 10, loss=lambda step, _: abs(step - 6) + 0.5)
    return tmp_path / "run"


# --------------------------------------------------------------------------- prune
def test_prune_dry_run_deletes_nothing(run: Path) -> None:
    assert invoke("tag", run / "step-000000004", "keep-me").exit_code == 0
    before = snapshot(run)
    res = invoke("prune", run, "--keep-last", "2", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    doc = as_json(res)
    assert doc["dry_run"] is True and doc["delete"] == ["step-000000002", "step-000000006"]
    assert {k["name"]: k["reasons"] for k in doc["keep"]} == {
        "step-000000010": ["newest", "last 2"], "step-000000008": ["last 2"], "step-000000004": ["tagged"]}
    text = invoke("prune", run, "--keep-last", "2", "--dry-run")
    assert text.exit_code == 0 and "would delete 2 of 5" in text.stdout and "nothing was deleted" in text.stdout
    assert snapshot(run) == before


def test_prune_deletes_what_retention_does_not_keep(run: Path) -> None:
    assert invoke("tag", run / "step-000000004", "keep-me").exit_code == 0
    res = invoke("prune", run, "--keep-last", "2", "--keep-best", "loss", "--json")
    assert res.exit_code == 0, res.output
    assert as_json(res)["delete"] == ["step-000000002"]
    assert steps(run) == ["step-000000004", "step-000000006", "step-000000008", "step-000000010"]
    with RunIndex(run, readonly=True) as index:
        assert [c["name"] for c in index.checkpoints("pruned")] == ["step-000000002"]
        assert [e["checkpoint"] for e in index.events("pruned")] == ["step-000000002"]
    res = invoke("prune", run, "--keep-last", "1")  # the tagged one and the newest stay whatever the rules
    assert res.exit_code == 0 and "deleted 2 of 4" in res.stdout
    assert steps(run) == ["step-000000004", "step-000000010"]


def test_prune_keep_best_of_a_maximised_metric(run: Path) -> None:
    res = invoke("prune", run, "--keep-last", "1", "--keep-best", "loss:2", "--best-mode", "max", "--json")
    assert res.exit_code == 0, res.output
    assert steps(run) == ["step-000000002", "step-000000010"]  # the two highest losses (4.5); 10 is the newest too


def test_prune_and_tag_are_refused_while_a_process_writes_the_run(run: Path) -> None:
    with writer_process(run):
        res = invoke("prune", run, "--keep-last", "1")
        assert res.exit_code == 1
        assert "cannot prune" in res.output and "pid" in res.output and "wait until that process exits" in res.output
        res = invoke("tag", run / "step-000000002", "best")
        assert res.exit_code == 1 and "another process" in res.output
        assert steps(run) == ["step-000000002", "step-000000004", "step-000000006", "step-000000008",
                              "step-000000010"]
        assert not (run / "tags.json").exists()
        dry = invoke("prune", run, "--keep-last", "1", "--dry-run", "--json")  # takes no lock: allowed
        assert dry.exit_code == 0 and len(as_json(dry)["delete"]) == 4
    assert invoke("prune", run, "--keep-last", "1").exit_code == 0
    assert steps(run) == ["step-000000010"]


def test_prune_refuses_bad_arguments_and_foreign_folders(run: Path, tmp_path: Path) -> None:
    assert invoke("prune", run).exit_code == 2  # --keep-last is required
    assert invoke("prune", run, "--keep-last", "0").exit_code == 2
    assert invoke("prune", run, "--keep-last", "1", "--keep-best", "loss:0").exit_code == 2
    assert invoke("prune", run, "--keep-last", "1", "--keep-best", "loss", "--best-mode", "median").exit_code == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("1,2\n")
    before = snapshot(foreign)
    res = invoke("prune", foreign, "--keep-last", "1")
    assert res.exit_code == 1 and "not an unbroken run" in res.output
    assert snapshot(foreign) == before
    assert len(steps(run)) == 5


# ----------------------------------------------------------------------------- tag
def test_tag_a_checkpoint_then_move_the_tag(run: Path) -> None:
    res = invoke("tag", run / "step-000000002", "best", "--json")
    assert res.exit_code == 0, res.output
    assert as_json(res) == {"run": str(run), "checkpoint": "step-000000002", "tag": "best"}
    assert json.loads((run / "tags.json").read_text()) == {"best": "step-000000002"}
    listed = {c["name"]: c["tags"] for c in as_json(invoke("ls", run, "--json"))["checkpoints"]}
    assert listed["step-000000002"] == ["best"] and listed["step-000000004"] == []
    with RunIndex(run, readonly=True) as index:
        assert [(e["message"], e["checkpoint"]) for e in index.events("tagged")] == [("best", "step-000000002")]
    moved = invoke("tag", run / "step-000000004", "best")  # a tag names one checkpoint: it moves
    assert moved.exit_code == 0 and moved.stdout.strip() == f"tagged {run / 'step-000000004'} as best"
    listed = {c["name"]: c["tags"] for c in as_json(invoke("ls", run, "--json"))["checkpoints"]}
    assert listed["step-000000002"] == [] and listed["step-000000004"] == ["best"]
    ckpt = unbroken.Checkpointer(run, preemption=None)
    assert ckpt.restore(make_state(), tag="best").step == 4
    ckpt.close()


def test_tag_refuses_bad_names_and_missing_checkpoints(run: Path) -> None:
    res = invoke("tag", run / "step-000000002", "not a tag!")
    assert res.exit_code == 2 and "invalid tag" in res.output
    res = invoke("tag", run / "step-000000003", "best")
    assert res.exit_code == 1 and "not a committed checkpoint" in res.output
    assert not (run / "tags.json").exists()
