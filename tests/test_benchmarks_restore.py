"""benchmarks/bench_restore.py run for real at a small size: the row "restore in a fresh
process" keeps working (every process runs, every restore is bitwise equal to the saved state,
the ratios to ``torch.load`` and to the raw read are written). No time is asserted: speed is
the benchmark's to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "bench_restore.py"
KEYS = ("restore1_s", "restore2_s", "torch_load_s", "torch_load_apply_s", "raw_read_s", "restore1_cpu_s",
        "torch_load_cpu_s", "restore_over_torch_load", "restore_over_raw_read", "state_bytes", "runs")


@pytest.mark.slow  # runs long
def test_a_small_run_restores_exactly_and_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--reps", "1", "--layers", "1", "--dim", "64", "--vocab", "512",
                        "--threads", "1", "--dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert set(KEYS) <= doc.keys(), f"missing: {set(KEYS) - doc.keys()}"
    assert {r["kind"] for r in doc["runs"]} == {"unbroken", "torch", "raw"} and all(r["exact"] for r in doc["runs"])
    assert "first restore / torch.load:" in p.stdout
