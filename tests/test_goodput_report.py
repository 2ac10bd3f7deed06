"""``unbroken goodput RUN``: where a run's time went, from its index, on real runs.

End to end: a training process killed with SIGKILL (inside a save, or after a step), resumed, and the
report checked by relations (never by durations): two segments, the steps redone are exactly those
the killed process computed after the step its successor resumed from, the parts add up to the wall
time, the ratio is in (0, 1], saves blocked for some time. An index written before the progress table
(the table dropped, as an older unbroken wrote it) reports what it can, the rest as unknown, not 0.
"""

from __future__ import annotations

import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.image import imread
from test_cli import as_json, invoke, train

from unbroken.demo import run_attempt
from unbroken.run.index.index import INDEX_FILE, RunIndex

LOOP = """
import sys, torch, unbroken
run, steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optimizer": opt}
ckpt = unbroken.Checkpointer(run, save_every=5, preemption=None)
ckpt.restore(state)
while ckpt.progress.step < steps:
    s = ckpt.progress.step + 1
    loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    ckpt.step(state, loss=loss.item())
ckpt.close()
"""
PARTS = ("productive_s", "redone_s", "blocked_s", "restart_s")


def report(run: Path) -> dict[str, Any]:
    res = invoke("goodput", run, "--json")
    assert res.exit_code == 0, res.output
    return as_json(res)


def check_relations(doc: dict[str, Any]) -> None:
    """What holds for every fully recorded run, whatever the timings."""
    total, segs = doc["total"], doc["segments"]
    assert total["segments"] == len(segs) and total["restarts"] == len(segs) - 1
    assert all(total[k] is not None and total[k] >= 0 for k in PARTS), total
    assert total["productive_s"] <= total["wall_s"]
    assert 0 < total["ratio"] <= 1
    assert math.isclose(sum(total[k] for k in PARTS), total["wall_s"], rel_tol=1e-9, abs_tol=1e-9), total
    for k in ("productive_s", "redone_s", "blocked_s", "redone_steps", "saves", "steps"):
        assert math.isclose(sum(s[k] for s in segs), total[k], rel_tol=1e-9, abs_tol=1e-9), k
    for s in segs:
        assert math.isclose(s["productive_s"] + s["redone_s"] + s["blocked_s"], s["active_s"], rel_tol=1e-9,
                            abs_tol=1e-9), s
    for prev, nxt in zip(segs, segs[1:], strict=False):
        assert nxt["started"] >= prev["end"] and nxt["restart_s"] == pytest.approx(nxt["started"] - prev["end"])
        assert nxt["redone_steps"] is not None
        assert prev["redone_steps"] == max(0, prev["last_step"] - max(prev["start_step"], nxt["start_step"]))
    assert segs[0]["restart_s"] is None and segs[-1]["redone_steps"] == 0


def test_a_sigkill_inside_a_save_the_steps_redone_and_where_the_time_went(tmp_path: Path) -> None:
    """Killed inside the save of step 15 (saves every 5 steps), resumed from step 10 and run to 20: the
    killed process had reached step 15 (its progress is committed at the save point, before the write),
    so 5 steps were redone, timed from its save at step 10 to its step 15."""
    run, script = tmp_path / "run", tmp_path / "loop.py"
    script.write_text(LOOP)
    killed = subprocess.run([sys.executable, str(script), str(run), "20"], capture_output=True, timeout=120,
                            env=dict(os.environ, UNBROKEN_FAULTS="save.before_commit=3"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    train(run, 20, save_every=5)  # the next process: resumes from step 10, in this one
    doc = report(run)
    check_relations(doc)
    first, second = doc["segments"]
    assert (first["how"], second["how"]) == ("not closed", "ended")
    assert first["recorded"] and second["recorded"] and doc["unknown"] == {}
    assert (first["start_step"], first["last_step"], second["start_step"], second["last_step"]) == (0, 15, 10, 20)
    assert first["redone_steps"] == 5 == first["last_step"] - second["start_step"]
    assert first["redone_s"] > 0 and not first["redone_estimated"]
    assert doc["total"]["steps"] == 25 and doc["total"]["redone_steps"] == 5
    assert first["saves"] == 2 and second["saves"] == 2  # the save killed inside never stopped blocking
    assert first["blocked_s"] > 0 and second["blocked_s"] > 0
    assert first["startup_s"] is not None and first["startup_s"] > 0  # a process of its own
    text = invoke("goodput", run)
    assert text.exit_code == 0, text.output
    assert "effective training time ratio" in text.stdout and "not closed" in text.stdout
    assert "steps redone" in text.stdout and "total" in text.stdout and "?" not in text.stdout


@pytest.mark.e2e
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_demo_killed_after_a_step_reports_through_the_installed_program(tmp_path: Path) -> None:
    """The demo's training job SIGKILLed once after step 17 (saves every 5), resumed to 40; ``python -m
    unbroken.cli goodput RUN --json --plot``: the killed process reached at most the step it printed last,
    its steps after the resumed one are the steps redone, and the picture shows the four parts."""
    base = tmp_path
    cmd = [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out", str(base / "out"),
           "--steps", "40", "--save-every", "5", "--hidden", "256", "--seed", "3"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    killed = run_attempt(cmd, "step", "17", env)
    assert killed.ended.startswith("killed"), killed
    assert run_attempt(cmd, "none", "", env).ended == "finished"
    png = tmp_path / "goodput.png"
    res = subprocess.run([sys.executable, "-m", "unbroken.cli", "goodput", str(base / "run"), "--json", "--plot",
                          str(png)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    import json
    doc = json.loads(res.stdout)
    check_relations(doc)
    first, second = doc["segments"]
    assert second["start_step"] in (15, 10) and second["last_step"] == 40 and second["how"] == "ended"
    assert second["start_step"] <= first["last_step"] <= killed.last_step
    assert first["redone_steps"] == first["last_step"] - second["start_step"]
    assert doc["total"]["saves"] >= 5 and doc["total"]["blocked_s"] > 0  # (a killed save point may be lost)
    assert str(png) in res.stderr and png.read_bytes().startswith(b"\x89PNG")
    assert found_colour(png, (0x2C, 0xA0, 0x2C)) and found_colour(png, (0xD6, 0x27, 0x28))  # productive, restart


def found_colour(png: Path, colour: tuple[int, int, int], tolerance: int = 8) -> bool:
    rgb = (imread(png)[..., :3] * 255).round().astype(int)
    return bool((abs(rgb - colour) <= tolerance).all(axis=-1).any())


def drop_progress(run: Path) -> None:
    """Make the index what an unbroken before the progress table wrote: the same tables, less that one."""
    with sqlite3.connect(run / INDEX_FILE) as c:
        c.execute("DROP TABLE progress")
    c.close()


def test_an_index_written_before_the_progress_table_reports_what_it_can(tmp_path: Path) -> None:
    """Steps 1-3 (saves at 2), a process that resumes from 2 and runs to 5, the progress table dropped:
    wall, restart, steps and steps redone come from the segments, metric rows and events; the time
    saves blocked, hence productive time and the ratio, is unknown (null, ?), never 0."""
    run = tmp_path / "run"
    train(run, 3)
    train(run, 5)
    drop_progress(run)
    doc = report(run)
    with sqlite3.connect(run / INDEX_FILE) as c:  # read-only: a reader does not add the table
        assert not c.execute("SELECT name FROM sqlite_master WHERE name = 'progress'").fetchall()
    c.close()
    total, (first, second) = doc["total"], doc["segments"]
    assert total["wall_s"] > 0 and total["restart_s"] >= 0 and total["restarts"] == 1
    assert (first["last_step"], second["start_step"], second["last_step"]) == (3, 2, 5)
    assert first["redone_steps"] == 1 and total["redone_steps"] == 1 and total["steps"] == 6
    for k in ("blocked_s", "productive_s", "ratio"):
        assert total[k] is None and k in doc["unknown"], k
    assert not first["recorded"] and first["blocked_s"] is None and first["productive_s"] is None
    assert first["saves"] == 1 and second["saves"] == 1  # committed saves (2; 4), from the events
    text = invoke("goodput", run)
    assert text.exit_code == 0 and "?" in text.stdout and "unknown" in text.stderr
    assert "effective training time ratio: ?" in text.stdout

    # a newer writer adds the table; the old segments stay unknown, the new one is recorded
    train(run, 7)
    doc = report(run)
    assert [s["recorded"] for s in doc["segments"]] == [False, False, True]
    assert doc["total"]["ratio"] is None and doc["segments"][2]["blocked_s"] > 0
    assert doc["segments"][2]["productive_s"] is not None


def test_a_segment_that_recorded_no_step_and_a_rebuilt_index(tmp_path: Path) -> None:
    """Without the progress table and without metric rows or saves, a killed segment's last step is
    unknown (so are its steps redone); an index rebuilt in memory has no segments: nothing to report."""
    run = tmp_path / "run"
    train(run, 2)
    with RunIndex(run) as index:  # a process that resumed and died before its first step or save
        index.start_segment("step-000000002", 2)
    train(run, 4)
    drop_progress(run)
    doc = report(run)
    middle = doc["segments"][1]
    assert middle["last_step"] is None and middle["redone_steps"] is None and middle["how"] == "not closed"
    assert doc["total"]["redone_steps"] is None and "redone_steps" in doc["unknown"]
    for f in run.glob(f"{INDEX_FILE}*"):
        f.unlink()
    res = invoke("goodput", run, "--json")
    assert res.exit_code == 0 and as_json(res)["segments"] == [] and as_json(res)["total"]["wall_s"] is None
    assert "no segment recorded" in invoke("goodput", run).stdout


def test_a_resume_that_lost_steps_in_process(tmp_path: Path) -> None:
    """In-process segments: saves at 2 and 4, a stop after 5, a resume from 2 (an earlier checkpoint):
    steps 3-5 redone, timed from the save at 2; every part known."""
    run = tmp_path / "run"
    train(run, 5)
    train(run, 6, resume_from=run / "step-000000002")
    doc = report(run)
    check_relations(doc)
    first = doc["segments"][0]
    assert first["redone_steps"] == 3 and first["redone_s"] > 0 and not first["redone_estimated"]
    assert first["how"] == "ended" and first["startup_s"] is not None


def test_plot_draws_the_parts_and_replaces_only_its_own_png(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, 5)
    train(run, 6, resume_from=run / "step-000000002")
    png = tmp_path / "gp.png"
    res = invoke("goodput", run, "--plot", png)
    assert res.exit_code == 0, res.output
    assert str(png) in res.stdout and found_colour(png, (0x2C, 0xA0, 0x2C)) and found_colour(png, (0xFF, 0x7F, 0x0E))
    assert invoke("goodput", run, "--plot", png).exit_code == 0  # its own picture: replaced
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"not unbroken's")
    refused = invoke("goodput", run, "--plot", mine)
    assert refused.exit_code == 1 and "--force" in refused.output and mine.read_bytes() == b"not unbroken's"
    assert invoke("goodput", run, "--plot", mine, "--force").exit_code == 0
    assert mine.read_bytes().startswith(b"\x89PNG")


def test_an_in_process_rollback_is_a_segment_whose_restart_holds_the_restore(tmp_path: Path) -> None:
    """``recover()``: an exception at step 7 (saves every 5) rolls back to step 5 in the same process and
    trains on to 10: two segments, the first ``rolled back`` with steps 6 redone (7 failed before its
    boundary), the second in the same process (no start-up of its own)."""
    import torch

    import unbroken
    from test_cli import make_state

    run = tmp_path / "run"
    state = make_state()
    ckpt = unbroken.Checkpointer(run, save_every=5, preemption=None)
    ckpt.restore(state)
    failed: list[int] = []

    def loop() -> None:
        model, opt = state["model"], state["optimizer"]
        while ckpt.progress.step < 10:
            step = ckpt.progress.step + 1
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean()
            if step == 7 and not failed:
                failed.append(step)
                raise FloatingPointError("a transient fault")
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(state, loss=loss.item())

    ckpt.recover(loop, state, on=(FloatingPointError,), retries=1)
    ckpt.close()
    doc = report(run)
    check_relations(doc)
    first, second = doc["segments"]
    assert first["how"] == "rolled back" and second["how"] == "ended"
    assert (first["last_step"], second["start_step"], second["last_step"]) == (6, 5, 10)
    assert first["redone_steps"] == 1 and not first["redone_estimated"]
    assert first["startup_s"] is not None and second["startup_s"] is None  # the same process
    assert second["restart_s"] > 0
