"""The command line: help, list, verify, inspect, against real checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import unbroken
from unbroken.cli import app

runner = CliRunner()


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=2, keep_last=None)
    state = {"model": model, "optimizer": opt}
    for _ in range(4):
        ckpt.step(state, loss=0.5)
    return tmp_path / "run"


def test_help_from_the_installed_script() -> None:
    out = subprocess.run([sys.executable, "-m", "unbroken.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("demo", "list", "verify", "inspect"):
        assert command in out.stdout


def test_version() -> None:
    out = runner.invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"unbroken {unbroken.__version__}"


def test_list_shows_checkpoints_newest_first(run: Path) -> None:
    res = runner.invoke(app, ["list", str(run)])
    assert res.exit_code == 0, res.output
    assert res.output.index("step-000000004") < res.output.index("step-000000002")
    assert "loss" in res.output


def test_list_of_empty_folder_fails(tmp_path: Path) -> None:
    assert runner.invoke(app, ["list", str(tmp_path)]).exit_code == 1


def test_verify_ok_then_bad(run: Path) -> None:
    res = runner.invoke(app, ["verify", str(run)])
    assert res.exit_code == 0, res.output
    assert sum(line.startswith("ok") for line in res.output.splitlines()) == 2
    victim = run / "step-000000004" / "t00-model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = runner.invoke(app, ["verify", str(run)])
    assert res.exit_code == 1
    assert "BAD" in res.output and "checksum" in res.output
    assert runner.invoke(app, ["verify", str(run / "step-000000002")]).exit_code == 0


def test_inspect_lists_tensors(run: Path) -> None:
    res = runner.invoke(app, ["inspect", str(run / "step-000000004")])
    assert res.exit_code == 0, res.output
    assert "model/weight" in res.output and "F32" in res.output and "[4, 8]" in res.output


def test_events_and_metrics_continuity(tmp_path: Path) -> None:
    w = torch.zeros(1)
    ckpt = unbroken.Checkpointer(tmp_path / "run", save_every=2, keep_last=None, preemption=None)
    for step in range(4):
        ckpt.step({"w": w}, loss=float(step))
    ckpt.close()
    again = unbroken.Checkpointer(tmp_path / "run", save_every=2, keep_last=None, preemption=None)
    again.restore({"w": w}, path=tmp_path / "run" / "step-000000002")
    for step in range(2, 4):  # re-run steps 3 and 4: identical values
        again.step({"w": w}, loss=float(step))
    again.close()
    res = runner.invoke(app, ["events", str(tmp_path / "run")])
    assert res.exit_code == 0 and "resumed" in res.output and "saved" in res.output, res.output
    res = runner.invoke(app, ["metrics", str(tmp_path / "run"), "loss", "--check"])
    assert res.exit_code == 0 and "2 re-run steps checked, 0 differ" in res.output, res.output
    third = unbroken.Checkpointer(tmp_path / "run", save_every=2, keep_last=None, preemption=None)
    third.restore({"w": w}, path=tmp_path / "run" / "step-000000002")
    third.step({"w": w}, loss=99.0)  # a different value for step 3: not an exact resume
    third.close()
    res = runner.invoke(app, ["metrics", str(tmp_path / "run"), "loss", "--check"])
    assert res.exit_code == 1 and "step 3" in res.output, res.output
