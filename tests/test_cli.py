"""The command line (``unbroken ...``): help, ls, verify and inspect on real runs.

Runs are written by ``unbroken.Checkpointer``; damage is done the way it happens (a flipped
byte, a truncated manifest, a save that never committed, a restore that quarantined a bad
checkpoint). Other commands: ``test_cli_diff.py``, ``test_cli_maintain.py``, ``test_cli_runlog.py``.
"""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import unbroken
from unbroken.cli import app
from unbroken.store import open_store

runner = CliRunner()
COMMANDS = ("ls", "list", "verify", "inspect", "diff", "prune", "tag", "events", "metrics", "plot", "demo")


# ----------------------------------------------------------------- shared helpers
def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def train(run: Path, steps: int, *, resume_from: Path | None = None, save_every: int = 2,
          keep_last: int | None = None, loss: Callable[[int, float], float] | None = None, **options: Any) -> None:
    """Train a tiny model to ``steps`` with a Checkpointer (resuming as a restart would, or from
    ``resume_from``). The logged loss is computed from the model, so an exact resume re-logs the
    same values; ``loss(step, computed)`` may replace it."""
    state = make_state()
    ckpt = unbroken.Checkpointer(run, save_every=save_every, keep_last=keep_last, preemption=None, **options)
    ckpt.restore(state, path=resume_from) if resume_from else ckpt.restore(state)
    model, opt = state["model"], state["optimizer"]
    while ckpt.progress.step < steps:
        step = ckpt.progress.step + 1
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        value = model(x).pow(2).mean()
        value.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss(step, value.item()) if loss else value.item())
    ckpt.close()


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def invoke(*args: str, **kw: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args], **kw)


def as_json(result: Any) -> Any:
    return json.loads(result.stdout)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` with its bytes (None for folders)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    train(tmp_path / "run", 4)
    return tmp_path / "run"


# ------------------------------------------------------------------- the program
def test_help_from_the_installed_script() -> None:
    out = subprocess.run([sys.executable, "-m", "unbroken.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for command in COMMANDS:
        if command != "list":  # a hidden alias
            assert f"  {command} " in out.stdout, command
    assert "  list " not in out.stdout


def test_installed_script_lists_a_run_as_json(run: Path) -> None:
    script = shutil.which("unbroken", path=str(Path(sys.executable).parent))
    assert script is not None, "the unbroken script is not installed next to this python"
    out = subprocess.run([script, "ls", str(run), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert [c["name"] for c in json.loads(out.stdout)["checkpoints"]] == ["step-000000004", "step-000000002"]


def test_version() -> None:
    out = invoke("--version")
    assert out.exit_code == 0 and out.output.strip() == f"unbroken {unbroken.__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_no_type_labels_on_flags(command: str) -> None:
    res = invoke(command, "--help")
    assert res.exit_code == 0, res.output
    assert "--help" in res.output and "<bool>" not in res.output


def test_a_library_error_is_one_line_and_exit_1(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    res = invoke("ls", tmp_path / "file")
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [f"StorageError: {tmp_path / 'file'} exists and is not a folder; "
                                               "choose another run location"]


def test_url_locations(tmp_path: Path) -> None:
    url = f"memory://cli-{tmp_path.name}/run"  # an fsspec store, as s3:// would be
    train(url, 6)
    res = invoke("ls", url, "--json")
    assert res.exit_code == 0, res.output
    assert [c["path"] for c in as_json(res)["checkpoints"]] == [f"{url}/step-00000000{s}" for s in (6, 4, 2)]
    assert invoke("verify", f"{url}/step-000000002").exit_code == 0
    assert invoke("inspect", f"{url}/step-000000004", "--tensor", "model/bias").exit_code == 0
    assert invoke("tag", f"{url}/step-000000002", "best").exit_code == 0
    assert as_json(invoke("prune", url, "--keep-last", "1", "--json"))["delete"] == ["step-000000004"]
    assert [c["name"] for c in as_json(invoke("ls", url, "--json"))["checkpoints"]] == ["step-000000006",
                                                                                      "step-000000002"]
    assert invoke("ls", f"memory://cli-{tmp_path.name}/elsewhere").exit_code == 1


# ------------------------------------------------------------------------------ ls
def test_ls_shows_checkpoints_newest_first(run: Path) -> None:
    res = invoke("ls", run)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    row4 = next(line for line in lines if "step-000000004" in line)
    row2 = next(line for line in lines if "step-000000002" in line)
    assert lines.index(row4) < lines.index(row2)
    assert "*" in row4 and "*" not in row2  # the newest is marked
    assert "committed" in row4 and "loss=" in row4


def test_list_is_a_hidden_alias_of_ls(run: Path) -> None:
    res = invoke("list", run, "--json")
    assert res.exit_code == 0
    assert [c["name"] for c in as_json(res)["checkpoints"]] == ["step-000000004", "step-000000002"]


def _damaged_run(root: Path) -> Path:
    """Steps 2, 4, 6, 8; step 8 damaged and quarantined by a restore; a flipped byte in step 6
    (not noticed without --verify); step 4's manifest truncated; a save of step 10 never committed."""
    run = root / "run"
    train(run, 8)
    flip_byte(run / "step-000000008" / "t00-model.safetensors")
    train(run, 6)  # the restore quarantines step 8 and resumes from step 6; nothing is left to train
    flip_byte(run / "step-000000006" / "t00-model.safetensors")
    manifest = run / "step-000000004" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    staging = open_store(run).stage("step-000000010")  # what a writer killed mid-save leaves
    with staging.open("t00-model.safetensors") as f:
        f.write(b"half a file")
    return run


def test_ls_shows_every_status(tmp_path: Path) -> None:
    run = _damaged_run(tmp_path)
    res = invoke("ls", run, "--json")
    assert res.exit_code == 1, res.output  # a corrupt checkpoint was found
    doc = as_json(res)
    assert doc["run"] == str(run) and doc["verified"] is False
    rows = {c["name"]: c for c in doc["checkpoints"]}
    assert {n: r["status"] for n, r in rows.items()} == {
        "step-000000006": "committed", "step-000000002": "committed", "step-000000004": "corrupt",
        "step-000000010": "uncommitted", "step-000000008": "quarantined"}
    assert [c["name"] for c in doc["checkpoints"] if c["newest"]] == ["step-000000006"]
    assert "manifest.json" in rows["step-000000004"]["reason"]
    assert "checksum" in rows["step-000000008"]["reason"]
    assert rows["step-000000008"]["step"] == 8  # its manifest is still readable
    assert rows["step-000000002"]["metrics"]["loss"] > 0 and rows["step-000000002"]["epoch"] == 0
    text = invoke("ls", run)
    assert text.exit_code == 1
    for name, status in (("step-000000004", "corrupt"), ("step-000000010", "uncommitted"),
                         ("step-000000008", "quarantined")):
        assert status in next(line for line in text.stdout.splitlines() if name in line)


def test_ls_verify_finds_what_the_manifests_hide(tmp_path: Path) -> None:
    run = _damaged_run(tmp_path)
    res = invoke("ls", run, "--verify", "--json")
    assert res.exit_code == 1
    rows = {c["name"]: c for c in as_json(res)["checkpoints"]}
    assert rows["step-000000006"]["status"] == "corrupt" and "checksum" in rows["step-000000006"]["reason"]
    assert rows["step-000000002"]["status"] == "valid" and rows["step-000000002"]["reason"] == ""


def test_ls_of_a_healthy_run_verified(run: Path) -> None:
    res = invoke("ls", run, "--verify", "--json")
    assert res.exit_code == 0
    assert {c["status"] for c in as_json(res)["checkpoints"]} == {"valid"}


def test_ls_tiered_shows_remote_only_checkpoints(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    train(local, 8, keep_last=1, remote=unbroken.Remote(str(remote), keep_last=None))
    only_remote = {p.name for p in remote.glob("step-*")} - {p.name for p in local.glob("step-*")}
    assert only_remote, "the test needs checkpoints that local retention deleted"
    res = invoke("ls", local, "--remote", remote, "--json")
    assert res.exit_code == 0, res.output
    rows = as_json(res)["checkpoints"]
    assert {c["name"] for c in rows if c["status"] == "remote-only"} == only_remote
    assert all(c["tiers"] == ["remote"] for c in rows if c["status"] == "remote-only")
    assert {c["name"] for c in rows if c["tiers"] == ["local", "remote"]} == {"step-000000008"}
    alone = as_json(invoke("ls", local, "--json"))["checkpoints"]
    assert [c["name"] for c in alone] == ["step-000000008"]


def test_ls_of_empty_missing_and_foreign_folders_fails(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("hello")
    for folder, why in (("empty", "not an unbroken run"), ("foreign", "not an unbroken run"),
                        ("missing", "no such folder")):
        res = invoke("ls", tmp_path / folder)
        assert res.exit_code == 1 and why in res.output, res.output


def test_tables_do_not_wrap_when_piped(run: Path) -> None:
    res = invoke("ls", run, env={"COLUMNS": None})
    row = next(line for line in res.stdout.splitlines() if "step-000000004" in line)
    assert len(row) > 80 and "committed" in row  # one line, wider than a default 80-column console
    narrow = invoke("ls", run, env={"COLUMNS": "70"})
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 70


# -------------------------------------------------------------------------- verify
def test_verify_a_run_then_a_damaged_one(run: Path) -> None:
    res = invoke("verify", run)
    assert res.exit_code == 0, res.output
    assert sum(line.startswith("ok") for line in res.stdout.splitlines()) == 2
    flip_byte(run / "step-000000004" / "t00-model.safetensors")
    res = invoke("verify", run, "--json")
    assert res.exit_code == 1
    doc = as_json(res)
    assert doc["ok"] is False
    bad = {c["name"]: c["error"] for c in doc["checkpoints"] if not c["ok"]}
    assert list(bad) == ["step-000000004"] and "checksum" in bad["step-000000004"]
    assert invoke("verify", run / "step-000000002").exit_code == 0
    single = invoke("verify", run / "step-000000004", "--json")
    assert single.exit_code == 1 and [c["name"] for c in as_json(single)["checkpoints"]] == ["step-000000004"]


def test_verify_a_checkpoint_whose_manifest_is_gone(run: Path) -> None:
    (run / "step-000000004" / "manifest.json").unlink()
    res = invoke("verify", run / "step-000000004")
    assert res.exit_code == 1 and "BAD" in res.output and "manifest.json is missing" in res.output


def test_verify_of_a_foreign_folder_fails(tmp_path: Path) -> None:
    res = invoke("verify", tmp_path)
    assert res.exit_code == 1 and "no checkpoints" in res.output


def _on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, bytes]:
    """Run the installed program with a pseudo-terminal as stdin, stdout and stderr."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "unbroken.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, **env}, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), b"".join(chunks)


def test_verify_shows_a_progress_bar_on_a_terminal_only(run: Path) -> None:
    rc, shown = _on_a_terminal(["verify", str(run)], {"UNBROKEN_PROGRESS": "1", "COLUMNS": "120"})
    assert rc == 0
    assert b"verifying 2 checkpoints" in shown and b"\xe2\x94\x81" in shown  # the description and the bar
    piped = invoke("verify", run, env={"UNBROKEN_PROGRESS": "1"})
    assert piped.exit_code == 0 and "verifying" not in piped.output and "\u2501" not in piped.output


# ------------------------------------------------------------------------- inspect
def test_inspect_lists_tensors(run: Path) -> None:
    res = invoke("inspect", run / "step-000000004")
    assert res.exit_code == 0, res.output
    row = next(line for line in res.stdout.splitlines() if "model/weight" in line)
    assert "F32" in row and "[4, 8]" in row
    doc = as_json(invoke("inspect", run / "step-000000004", "--json"))
    assert doc["step"] == 4 and doc["metrics"]["loss"] > 0 and doc["progress"]["step"] == 4
    assert {"file": "t00-model.safetensors", "name": "model/weight", "dtype": "F32", "shape": [4, 8]} in doc["tensors"]
    assert doc["environment"]["torch"] == torch.__version__


def test_inspect_shows_the_values_that_are_not_tensors(tmp_path: Path) -> None:
    """Loop variables, an optimizer's hyperparameters, a loader's position, strings and None: shown by path;
    tensors and RNG states left out (the tensor table has the tensors)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    loop = unbroken.Vars(lr=0.125, best=None, note="warm-up", steps=[1, 2, 3])
    loader = unbroken.data.ResumableLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), 2, True, seed=4)
    state = {"model": model, "optimizer": opt, "loop": loop, "data": loader}
    with unbroken.Checkpointer(tmp_path / "run", save_every=1) as ckpt:
        ckpt.restore(state)
        for _ in loader:
            ckpt.step(state)
            break
    doc = as_json(invoke("inspect", tmp_path / "run" / "step-000000001", "--json"))
    values = doc["values"]
    assert values["loop/lr"] == "0.125" and values["loop/best"] == "None" and values["loop/note"] == "'warm-up'"
    assert values["loop/steps"] == "[1, 2, 3]"
    assert values["optimizer/param_groups/0/lr"] == "0.25" and values["optimizer/param_groups/0/momentum"] == "0.5"
    assert values["data/position"] == "2" and values["data/seed"] == "4"
    assert not any(k.startswith("model/") for k in values)  # tensors: the other table
    res = invoke("inspect", tmp_path / "run" / "step-000000001")
    assert res.exit_code == 0 and "loop/lr" in res.stdout and "'warm-up'" in res.stdout
    flip_byte(tmp_path / "run" / "step-000000001" / "state.json")
    assert "checksum" in as_json(invoke("inspect", tmp_path / "run" / "step-000000001", "--json"))["values"][""]


def test_inspect_one_tensor(run: Path) -> None:
    weight = unbroken.load(run / "step-000000004")["model"]["weight"].double()
    res = invoke("inspect", run / "step-000000004", "--tensor", "model/weight", "--json")
    assert res.exit_code == 0, res.output
    t = as_json(res)["tensor"]
    assert (t["name"], t["file"], t["dtype"], t["shape"], t["numel"]) == \
        ("model/weight", "t00-model.safetensors", "float32", [4, 8], 32)
    assert t["min"] == weight.min().item() and t["max"] == weight.max().item()
    assert t["mean"] == pytest.approx(weight.mean().item()) and t["l2_norm"] == pytest.approx(weight.norm().item())
    text = invoke("inspect", run / "step-000000004", "--tensor", "model/weight")
    assert text.exit_code == 0 and "L2 norm" in text.stdout and "float32" in text.stdout


def test_inspect_unknown_tensor_names_close_ones(run: Path) -> None:
    res = invoke("inspect", run / "step-000000004", "--tensor", "model/weights")
    assert res.exit_code == 1
    assert "no tensor 'model/weights'" in res.output and "model/weight" in res.output.split("close names:")[1]


def test_inspect_tensor_verifies_its_file(run: Path) -> None:
    flip_byte(run / "step-000000004" / "t00-model.safetensors")
    res = invoke("inspect", run / "step-000000004", "--tensor", "model/bias")
    assert res.exit_code == 1 and "checksum" in res.output


def test_inspect_a_broken_manifest_fails(run: Path) -> None:
    (run / "step-000000004" / "manifest.json").write_text("{")
    res = invoke("inspect", run / "step-000000004")
    assert res.exit_code == 1 and "CorruptCheckpointError" in res.output
