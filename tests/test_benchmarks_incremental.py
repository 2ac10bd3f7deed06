"""benchmarks/bench_incremental.py --quick, run for real: incremental checkpoints of a
LoRA-like model (frozen base, ~1 % trainable) write less than full ones, and about only what
changed (issue 16's goal: bytes written per save <= 1.1 x the changed tensor bytes).

The goal is checked with an allowance for what every checkpoint holds besides tensor bytes.
In the --quick model (8 frozen Linear(512, 512) layers, rank-3 adapters: 80 tensors, 295 kB
of them change per save) an incremental save writes, beyond the changed tensors, ~45 kB:
the checkpoint folder's manifest.json (~11 kB: one entry per chunk), state.json (~10 kB),
the two chunk maps (~11 kB: one entry per tensor) and rank-00000.json (~7 kB: the python
and numpy RNG states), plus the torch RNG state as a 5 kB chunk. 1.1 x covers ~30 kB of
that; METADATA (64 KiB) covers all of it with room for a longer argv or package list in the
manifest's environment. These grow with the number of tensors, not their size: at the
default size (36 layers, 360 tensors, ~18 MB changed per save) they are < 1 % of a save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "bench_incremental.py"
METADATA = 64 * 1024  # per-save bytes that are not changed tensors (see the module docstring)
KEYS = ("bytes_per_save_incremental", "bytes_per_save_full", "changed_bytes_per_save", "save_s_incremental",
        "save_s_full", "first_save", "machine", "model")


def test_quick_run_writes_about_only_what_changed(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert set(KEYS) <= doc.keys(), f"missing: {set(KEYS) - doc.keys()}"
    first = doc["first_save"]
    assert {"changed_bytes", "bytes_incremental", "bytes_full", "save_s_incremental", "save_s_full"} <= first.keys()
    assert doc["saves"] == 10 and all(len(v) == 10 for v in doc["per_save"].values())
    assert 0.005 < doc["model"]["trainable"] / doc["model"]["params"] < 0.02  # ~1 % trainable
    inc, full, changed = doc["bytes_per_save_incremental"], doc["bytes_per_save_full"], doc["changed_bytes_per_save"]
    # save 1 writes everything in both modes; later saves: only the adapters and their AdamW state change
    assert first["changed_bytes"] == doc["model"]["state_bytes"]
    assert first["bytes_incremental"] >= first["changed_bytes"] and first["bytes_full"] >= first["changed_bytes"]
    assert 0 < changed < 0.1 * doc["model"]["state_bytes"]
    assert full >= doc["model"]["state_bytes"]
    assert changed <= inc < full
    assert inc <= 1.1 * changed + METADATA, (inc, changed)
    assert doc["save_s_incremental"] > 0 and doc["save_s_full"] > 0
    assert [q for q in tmp_path.iterdir() if q != out] == [], "the benchmark left its runs behind"
