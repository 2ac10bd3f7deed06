"""tools/trace_walk.py (the walks of docs/architecture.md) runs on today's tree and finds the walk the docs
describe: a save down checkpointer/ -> checkpoint/ -> run/ -> store/, a restore through run/choosing.py and
checkpoint/reader.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
TOOL = Path(__file__).resolve().parent.parent / "tools" / "trace_walk.py"


def test_the_traced_walks_are_the_documented_ones(tmp_path: Path) -> None:
    out = tmp_path / "walks.json"
    p = subprocess.run([sys.executable, str(TOOL), "--json", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    walks = json.loads(out.read_text())
    save, restore = walks["step() that saves"], walks["restore()"]
    for module in ("checkpointer/manager.py", "checkpointer/saving.py", "checkpoint/snapshot.py",
                   "checkpoint/persist.py", "run/run.py", "run/collective.py", "store/local.py"):
        assert module in save["modules"], module
    for module in ("checkpointer/restoring.py", "run/choosing.py", "checkpoint/reader.py", "state/apply.py"):
        assert module in restore["modules"], module
    assert "checkpointer -> checkpoint" in save["crossings"] and "checkpointer -> run" in restore["crossings"]
    assert "modules in" in p.stdout and "folder boundaries crossed" in p.stdout
