"""``unbroken events``, ``metrics`` and ``plot`` on real runs, the plotting module, the demo's picture."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread
from test_cli import as_json, invoke, make_state, snapshot, train

import unbroken
from unbroken.demo import Attempt, plot_losses
from unbroken.run.index.index import RunIndex
from unbroken.run.index.plotting import Curve, Marker, figure, plot_curves, run_curves

TAB10 = {"C0": (0x1F, 0x77, 0xB4), "C1": (0xFF, 0x7F, 0x0E)}  # the colours of the first two curves


@pytest.fixture()
def resumed(tmp_path: Path) -> Path:
    """Steps 1-4 (saves at 2 and 4), then a resume from step 2 that re-runs steps 3 and 4 and goes
    on to 6: an interruption after step 4 that lost two steps, as a kill after a lost save would."""
    run = tmp_path / "run"
    train(run, 4)
    train(run, 6, resume_from=run / "step-000000002")
    return run


def colours(png: Path) -> tuple[np.ndarray, set[tuple[int, int, int]]]:
    rgb = (imread(png)[..., :3] * 255).round().astype(int)
    return rgb, {tuple(map(int, c)) for c in rgb.reshape(-1, 3)}


def near(found: set[tuple[int, int, int]], colour: tuple[int, int, int], tolerance: int = 8) -> bool:
    return any(all(abs(a - b) <= tolerance for a, b in zip(c, colour, strict=True)) for c in found)


# ------------------------------------------------------------------------- events
def test_events_of_a_resumed_run(resumed: Path) -> None:
    res = invoke("events", resumed, "--json")
    assert res.exit_code == 0, res.output
    doc = as_json(res)
    assert doc["rebuilt"] is False
    kinds = [e["kind"] for e in doc["events"]]
    assert kinds.count("run_started") == 1 and kinds.count("resumed") == 1 and kinds.count("saved") == 4
    resume = next(e for e in doc["events"] if e["kind"] == "resumed")
    assert resume["checkpoint"] == "step-000000002" and resume["step"] == 2
    assert resume["data"] == {"tier": "path"}  # named by its path (restore(path=...))
    only = as_json(invoke("events", resumed, "--kind", "saved", "--json"))["events"]
    assert [e["checkpoint"] for e in only] == ["step-000000002", "step-000000004", "step-000000004-2",
                                               "step-000000006"]
    text = invoke("events", resumed)
    assert text.exit_code == 0 and "resumed" in text.stdout and "step-000000004-2" in text.stdout
    none = invoke("events", resumed, "--kind", "preempted")
    assert none.exit_code == 0 and "kinds in this run" in none.output and "saved" in none.output


def test_events_without_an_index_are_rebuilt_in_memory(resumed: Path) -> None:
    for f in resumed.glob("index.sqlite*"):
        f.unlink()
    before = snapshot(resumed)
    res = invoke("events", resumed, "--json")
    assert res.exit_code == 0 and as_json(res)["rebuilt"] is True
    assert "rebuilt in memory" in res.stderr
    assert snapshot(resumed) == before  # read-only: no index file was created


@pytest.mark.parametrize("command", [["events"], ["metrics", "loss"], ["metrics", "loss", "--check"], ["plot"]])
def test_a_folder_that_is_not_a_run_is_refused_and_left_alone(tmp_path: Path, command: list[str]) -> None:
    folder = tmp_path / "not-a-run"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    (folder / "tensorboard").mkdir()
    before = snapshot(folder)
    res = invoke(command[0], folder, *command[1:])
    assert res.exit_code == 1 and "not an unbroken run" in res.output, res.output
    assert "index_rebuilt" not in res.output
    assert snapshot(folder) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke(command[0], empty, *command[1:]).exit_code == 1
    assert list(empty.iterdir()) == []
    assert invoke(command[0], tmp_path / "missing", *command[1:]).exit_code == 1
    assert not (tmp_path / "missing").exists()


# ------------------------------------------------------------------------ metrics
def test_metrics_per_step(resumed: Path) -> None:
    doc = as_json(invoke("metrics", resumed, "loss", "--json"))
    assert [(v["step"], v["segment"]) for v in doc["values"]] == [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2),
                                                                 (5, 2), (6, 2)]
    lines = invoke("metrics", resumed, "loss").stdout.splitlines()
    assert len(lines) == 8 and lines[0].split("\t")[0] == "1" and lines[0].split("\t")[2] == "1"
    assert float(lines[0].split("\t")[1]) == doc["values"][0]["value"]


def test_metrics_without_a_name_lists_the_names(resumed: Path) -> None:
    assert invoke("metrics", resumed).stdout.splitlines() == ["loss"]
    assert as_json(invoke("metrics", resumed, "--json"))["names"] == ["loss"]
    res = invoke("metrics", resumed, "--check")
    assert res.exit_code == 1 and "needs a metric NAME" in res.output


def test_a_metric_never_logged_names_the_known_ones(resumed: Path) -> None:
    for args in (["metrics", resumed, "accuracy"], ["metrics", resumed, "accuracy", "--check"],
                 ["plot", resumed, "--metric", "accuracy"]):
        res = invoke(*args)
        assert res.exit_code == 1 and "'accuracy' was never logged" in res.output and "logged: loss" in res.output


def test_metrics_check_of_an_exact_resume(resumed: Path) -> None:
    res = invoke("metrics", resumed, "loss", "--check")
    assert res.exit_code == 0, res.output
    assert "loss: 2 re-run steps compared, 0 differ" in res.stdout
    doc = as_json(invoke("metrics", resumed, "loss", "--check", "--json"))
    assert (doc["ok"], doc["verdict"], doc["compared"], doc["checked"], doc["disagreeing"], doc["resumes"]) == \
        (True, "continuous", 2, [3, 4], [], 1)
    assert res.stdout.strip().splitlines()[-1] == "ok"


def test_metrics_check_catches_a_different_value(resumed: Path) -> None:
    train(resumed, 3, resume_from=resumed / "step-000000002", loss=lambda step, value: value + 1.0)
    res = invoke("metrics", resumed, "loss", "--check")
    assert res.exit_code == 1 and "step 3" in res.stdout and "not continuous" in res.stdout
    doc = as_json(invoke("metrics", resumed, "loss", "--check", "--json"))
    assert doc["ok"] is False and doc["disagreeing"] == [3]
    assert sorted(v["segment"] for v in doc["values"]["3"]) == [1, 2, 3]


def test_metrics_check_never_says_ok_after_comparing_0_steps(tmp_path: Path) -> None:
    """0 steps compared proves nothing: the verdict is "not checked", exit 1, "ok": false."""
    run = tmp_path / "run"
    train(run, 4)
    train(run, 6)  # resumes from step 4, the last step logged: no step is logged twice
    res = invoke("metrics", run, "loss", "--check")
    assert res.exit_code == 1, res.output
    assert "0 steps compared" in res.stdout and "resumed once" in res.stdout
    assert res.stdout.strip().splitlines()[-1] == "not checked" and "ok" not in res.stdout.split()
    doc = as_json(invoke("metrics", run, "loss", "--check", "--json"))
    assert (doc["ok"], doc["verdict"], doc["compared"], doc["resumes"]) == (False, "not checked", 0, 1)
    fresh = tmp_path / "fresh"
    train(fresh, 2)
    res = invoke("metrics", fresh, "loss", "--check")
    assert res.exit_code == 1 and "never resumed" in res.stdout and res.stdout.strip().endswith("not checked")


def test_metrics_check_reports_rows_lost_from_the_index(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, 4)
    with sqlite3.connect(run / "index.sqlite") as db:  # a row the save at step 4 had made durable, lost
        db.execute("DELETE FROM metrics WHERE name = 'loss' AND step = 3")
    db.close()
    res = invoke("metrics", run, "loss", "--check")
    assert res.exit_code == 1
    assert "1 step missing" in res.stdout and res.stdout.split("index): ")[1].startswith("3\n")
    doc = as_json(invoke("metrics", run, "loss", "--check", "--json"))
    assert (doc["ok"], doc["verdict"], doc["missing"], doc["compared"]) == (False, "not continuous", [3], 0)


# --------------------------------------------------------------------------- plot
def test_run_curves_of_a_resumed_run(resumed: Path) -> None:
    with RunIndex(resumed, readonly=True) as index:
        curves, markers = run_curves(index, "loss")
        logged = {(s, g): v for s, v, g in index.metric("loss")}
    assert [(c.label, list(c.steps)) for c in curves] == [
        ("segment 1 (fresh start)", [1, 2, 3, 4]), ("segment 2 (resumed from step-000000002)", [2, 3, 4, 5, 6])]
    assert curves[1].values[0] == logged[2, 1]  # the resumed line starts at the checkpoint's step
    assert Marker("interruption", 4, logged[4, 1]) in markers
    assert Marker("resume", 2, logged[2, 1]) in markers
    assert sorted(m.step for m in markers if m.kind == "save") == [2, 4, 6]  # both saves at 4: one point


def test_an_emergency_save_is_marked_as_an_interruption(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = make_state()
    ckpt = unbroken.Checkpointer(run, save_every=2, keep_last=None, preemption=None)
    ckpt.restore(state)
    with pytest.raises(RuntimeError, match="bad batch"), ckpt.guard(state):
        while True:
            if ckpt.progress.step == 3:
                raise RuntimeError("bad batch")  # in step 4, before the optimizer stepped
            state["optimizer"].step()
            ckpt.step(state, loss=1.0 / (ckpt.progress.step + 1))
    ckpt.close()
    train(run, 5)  # resumes from the emergency checkpoint of step 3
    with RunIndex(run, readonly=True) as index:
        assert [e["step"] for e in index.events("emergency_save")] == [3]
        _, markers = run_curves(index, "loss")
    assert [m.step for m in markers if m.kind == "interruption"] == [3]


def drawn(curves: list[Curve], markers: list[Marker]) -> dict[str, Any]:
    """What :func:`figure` drew: curve labels, the points of each marker kind, the ``×N`` counts."""
    ax = figure(curves, markers=markers).axes[0]
    return {"curves": [line.get_label() for line in ax.get_lines() if line.get_gid() == "curve"],
            "points": {c.get_gid(): [tuple(map(float, p)) for p in c.get_offsets()] for c in ax.collections},
            "counts": {t.get_gid(): t.get_text() for t in ax.texts}}


def test_a_process_that_died_before_its_first_logged_step_is_drawn_with_its_kill(tmp_path: Path) -> None:
    """Segment 2 restored from step 4 and ended before logging a step; segment 3 resumed from step 4
    too. All three segments are drawn, and segment 2's kill (where it started)."""
    run = tmp_path / "run"
    train(run, 4)
    state = make_state()
    ckpt = unbroken.Checkpointer(run, preemption=None)
    ckpt.restore(state)  # a new segment, resumed from step 4 ...
    ckpt.close()  # ... that logged nothing (killed in its first step, say)
    train(run, 6)
    with RunIndex(run, readonly=True) as index:
        assert [s["id"] for s in index.segments()] == [1, 2, 3]
        curves, markers = run_curves(index, "loss")
        at4 = next(v for s, v, g in index.metric("loss") if s == 4)
    assert [c.label for c in curves] == ["segment 1 (fresh start)",
                                         "segment 2 (resumed from step-000000004; no loss logged)",
                                         "segment 3 (resumed from step-000000004)"]
    assert (list(curves[1].steps), list(curves[1].values)) == ([4], [at4])
    assert [m for m in markers if m.kind == "interruption"] == [Marker("interruption", 4, at4)]
    assert [m for m in markers if m.kind == "resume"] == [Marker("resume", 4, at4)] * 2
    shown = drawn(curves, markers)
    assert shown["curves"] == [c.label for c in curves]
    assert shown["points"]["interruption"] == [(4.0, at4)] and shown["points"]["resume"] == [(4.0, at4)]
    assert shown["counts"] == {"resume-count": "×2"}


def test_a_kill_right_after_the_save_the_next_process_resumed_from_is_marked(tmp_path: Path) -> None:
    """A process SIGKILLed right after its save of step 4 (nothing lost: the next one resumes from step 4)
    left no ``closed`` event, unlike a process that ended: its kill is marked at step 4 (0.1 could not
    tell it from a clean exit). The process that ended normally gets no interruption marker."""
    import signal
    import subprocess
    import sys
    run = tmp_path / "run"
    code = (f"import os, signal, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
            f"from test_cli import train; train(Path({str(run)!r}), 2); "
            f"import unbroken; unbroken.Checkpointer.close = lambda self: os.kill(os.getpid(), signal.SIGKILL); "
            f"train(Path({str(run)!r}), 4)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    train(run, 6)
    with RunIndex(run, readonly=True) as index:
        assert [e["segment"] for e in index.events("closed")] == [1, 3]  # the killed one (2) left none
        curves, markers = run_curves(index, "loss")
        v4 = next(v for s, v, g in index.metric("loss") if s == 4)
    assert len(curves) == 3
    assert [m for m in markers if m.kind == "interruption"] == [Marker("interruption", 4, v4)]


KILLED_LOOP = """
import os, signal, sys, time, torch, unbroken
run, kill_after, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optimizer": opt}
ckpt = unbroken.Checkpointer(run, save_every=5)
ckpt.restore(state)
while ckpt.progress.step < steps:
    s = ckpt.progress.step + 1
    loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    time.sleep(0.15)  # a step of 150 ms
    ckpt.step(state, loss=loss.item())
    if s == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
ckpt.close()
"""


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_metrics_check_after_sigkills_only_compares_the_rows_the_killed_process_committed(tmp_path: Path) -> None:
    """SIGKILLed after step 13 (last save: 10), resumed from 10: the rows of steps 11-12 were committed while
    it ran (a commit every 0.25 s at most while the values are on the host; a commit survives a killed
    process), so --check compares the re-run steps against them and says ok; the row of the last
    fraction of a second (step 13) died with the process."""
    import subprocess
    import sys
    run, script = tmp_path / "run", tmp_path / "loop.py"
    script.write_text(KILLED_LOOP)
    killed = subprocess.run([sys.executable, str(script), str(run), "13", "16"], capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = subprocess.run([sys.executable, str(script), str(run), "0", "16"], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = as_json(invoke("metrics", run, "loss", "--check", "--json"))
    assert doc["verdict"] == "continuous" and doc["compared"] >= 1, doc
    res = invoke("metrics", run, "loss", "--check")
    assert res.exit_code == 0 and "ok" in res.stdout


def test_two_kills_between_the_same_checkpoints_are_two_kills(tmp_path: Path) -> None:
    """Killed after step 3 twice, each time resumed from the save at step 2: two interruptions at
    the same point (drawn once, marked ×2), two resumes, three segments."""
    run = tmp_path / "run"
    train(run, 3)  # saves at 2; "killed" after 3
    train(run, 3)  # resumes from 2, re-runs 3; "killed" again after 3
    train(run, 5)
    with RunIndex(run, readonly=True) as index:
        curves, markers = run_curves(index, "loss")
        v2, v3 = (next(v for s, v, g in index.metric("loss") if s == n) for n in (2, 3))
    assert len(curves) == 3
    assert [m for m in markers if m.kind == "interruption"] == [Marker("interruption", 3, v3)] * 2
    assert [m for m in markers if m.kind == "resume"] == [Marker("resume", 2, v2)] * 2
    shown = drawn(curves, markers)
    assert len(shown["curves"]) == 3 and shown["points"]["interruption"] == [(3.0, v3)]
    assert shown["counts"] == {"interruption-count": "×2", "resume-count": "×2"}


def test_plot_writes_a_png_with_a_colour_per_segment(resumed: Path, tmp_path: Path) -> None:
    res = invoke("plot", resumed, "-o", tmp_path / "out" / "loss.png")
    assert res.exit_code == 0, res.output
    png = tmp_path / "out" / "loss.png"
    assert res.stdout.strip() == str(png)
    assert png.stat().st_size > 10_000
    rgb, found = colours(png)
    assert (rgb < 250).any(axis=-1).mean() > 0.02  # not blank
    assert len(found) > 50
    assert near(found, TAB10["C0"]) and near(found, TAB10["C1"])  # segment 1 and segment 2


def test_plot_without_matplotlib_says_how_to_install_it(resumed: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib is an extra (``plot``): without it, one line that says how to get it, nothing drawn
    (tests/test_packaging.py checks the same in a fresh environment installed from the wheel)."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without it finds
    res = invoke("plot", resumed, "-o", tmp_path / "loss.png")
    assert res.exit_code == 1, res.output
    assert "drawing needs matplotlib" in res.output and "pip install -e '.[plot]'" in res.output, res.output
    assert not (tmp_path / "loss.png").exists()
    with pytest.raises(ModuleNotFoundError, match="drawing needs matplotlib"):
        figure([Curve("a", [1], [1.0])])


def test_plot_default_file_name_and_metric(resumed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = invoke("plot", resumed)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "run-loss.png" and (tmp_path / "run-loss.png").stat().st_size > 10_000


def test_plot_replaces_only_its_own_png_never_a_users_file_a_link_target_or_a_checkpoint_file(
        resumed: Path, tmp_path: Path) -> None:
    """The same class as export --to: plot -o must not destroy what unbroken did not write."""
    mine = tmp_path / "loss.png"
    assert invoke("plot", resumed, "-o", mine).exit_code == 0
    assert invoke("plot", resumed, "-o", mine).exit_code == 0  # its own plot: replaced, no --force needed
    users = tmp_path / "notes.png"
    users.write_bytes(b"the user's own picture")
    res = invoke("plot", resumed, "-o", users)
    assert res.exit_code != 0 and "--force" in res.output and users.read_bytes() == b"the user's own picture"
    assert invoke("plot", resumed, "-o", users, "--force").exit_code == 0 and users.stat().st_size > 10_000
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"keep")
    link = tmp_path / "link.png"
    link.symlink_to(precious)
    res = invoke("plot", resumed, "-o", link, "--force")
    assert res.exit_code == 0 and precious.read_bytes() == b"keep" and not link.is_symlink()  # replaced, not followed
    ckpt = next(p for p in sorted(resumed.iterdir()) if p.name.startswith("step-"))
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    for name in ["state.json", "new.png"]:
        res = invoke("plot", resumed, "-o", ckpt / name, "--force")
        assert res.exit_code != 0 and "inside" in res.output
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == before
    unbroken.verify(ckpt)


def test_plot_curves_draws_reference_curves_and_markers(tmp_path: Path) -> None:
    steps = list(range(1, 21))
    png = plot_curves([Curve("reference", steps, [1 / s for s in steps], reference=True),
                       Curve("attempt", steps[:10], [1 / s for s in steps[:10]])],
                      tmp_path / "p.png", markers=[Marker("interruption", 10, 0.1), Marker("save", 5, None)])
    _, found = colours(png)
    assert near(found, (204, 204, 204)) and near(found, TAB10["C0"])  # the grey band and the first colour
    assert near(found, (0xD6, 0x27, 0x28))  # the interruption's red


def test_the_demo_draws_both_runs_and_the_kills(tmp_path: Path) -> None:
    """The demo's picture from the files its runs leave (here written directly): the reference's
    losses, then two processes of the interrupted run, the first killed after step 6."""
    ref, got = tmp_path / "reference" / "out", tmp_path / "interrupted" / "out"
    ref.mkdir(parents=True)
    got.mkdir(parents=True)
    losses = {s: 2.0 / s for s in range(1, 13)}
    (ref / "losses.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    lines = list(range(1, 7)) + list(range(5, 13))
    (got / "losses.jsonl").write_text("".join(json.dumps({"step": s, "loss": losses[s]}) + "\n" for s in lines))
    attempts = [Attempt("SIGKILL after step 6", started="fresh start", ended="killed after step 6", logged=6),
                Attempt("run to the end", started="resumed from step 4", ended="finished", logged=14)]
    png = plot_losses(tmp_path, attempts, tmp_path / "losses.png")
    assert png == tmp_path / "losses.png" and png.stat().st_size > 10_000
    _, found = colours(png)
    assert near(found, TAB10["C0"]) and near(found, TAB10["C1"]) and near(found, (0xD6, 0x27, 0x28))


@pytest.mark.e2e
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_demo_ends_with_its_picture(tmp_path: Path) -> None:
    res = invoke("demo", "--steps", "24", "--kills", "1", "--seed", "1", "--workdir", tmp_path / "demo")
    assert res.exit_code == 0, res.output
    assert "bitwise identical: yes" in res.stdout
    shown = res.stdout.strip().splitlines()[-1]
    assert shown == f"loss curves: {tmp_path / 'demo' / 'losses.png'}"
    _, found = colours(tmp_path / "demo" / "losses.png")
    assert near(found, (204, 204, 204)) and near(found, TAB10["C0"]) and near(found, (0xD6, 0x27, 0x28))
