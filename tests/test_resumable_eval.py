"""The resumable evaluation example: SIGKILLed mid-pass and resumed, its metrics are bitwise equal."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from unbroken.demo import run_attempt

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parent.parent / "examples" / "resumable_eval.py"
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def cmd(base: Path) -> list[str]:
    return [sys.executable, str(SCRIPT), "--run-dir", str(base / "run"), "--out", str(base / "metrics.json")]


def test_killed_evaluation_resumes_to_identical_metrics(tmp_path: Path) -> None:
    assert run_attempt(cmd(tmp_path / "ref"), "none", "", ENV).ended == "finished"
    for target in (57, 201):
        att = run_attempt(cmd(tmp_path / "x"), "step", str(target), ENV)
        assert att.ended.startswith("killed"), att
    final = run_attempt(cmd(tmp_path / "x"), "none", "", ENV)
    assert final.started.startswith("resumed at batch 200"), final.started
    ref = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    got = json.loads((tmp_path / "x" / "metrics.json").read_text())
    assert ref == got and got["count"] == 20_000
