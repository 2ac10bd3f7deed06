"""The goodput benchmark's peer, a careful DIY loop over PyTorch DCP, under the same failures as
unbroken's configurations in tests/test_benchmarks_goodput.py: what it recovers, measured.

``benchmarks/bench_goodput.py --configs dcp`` with the test's tiny settings: a SIGKILLed rank and an
exception inside a step, one failure each. The DIY loop resumes from its last DCP checkpoint and
redoes the steps since; whether it ends bitwise equal to its uninterrupted run is reported (``exact``),
not required: that is the peer's behaviour, printed as a ``measured`` line for the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))
from test_benchmarks_goodput import SCRIPT, TINY  # noqa: E402 - after the tests folder is on the path

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_diy_dcp_loop_recovers_from_a_kill_and_an_exception(tmp_path: Path) -> None:
    out, work = tmp_path / "goodput.json", tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, str(SCRIPT), *TINY, "--configs", "dcp", "--kinds", "kill,exception",
           "--dir", str(work), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    rows = {r["kind"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "kill", "exception"}, rows
    for kind, r in rows.items():
        assert r["finished"] and 0 < r["goodput"] <= 1, r
        if kind != "none":
            (f,) = r["per_failure"]
            assert f["recovered"], r
            print(f"measured, DIY DCP, {kind}: goodput {r['goodput']:.3f}, steps redone {r['steps_redone']}, "
                  f"recovery {f['recovery_s']:.2f} s, exact {r['exact']}")
    assert list(work.iterdir()) == [], "the benchmark left its jobs behind"
