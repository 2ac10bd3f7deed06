"""benchmarks/bench_goodput.py with tiny settings, run for real: every configuration under a SIGKILLed
rank (``kill@1``: the kind with its own rate) and an exception inside a step (one failure each), checked
from the JSON it writes.

No timed assertions: what is checked is that the failures were injected as asked and recovered
from, that unbroken redid at most a save interval of steps per failure and ended bitwise equal to
its uninterrupted run, that goodput is a share of the wall time, that every configuration ran
(the RAM tier and in-process recovery included: "not available" would be a regression) — with
``--one-reference``, each one bitwise equal to the one uninterrupted job of the first (same steps, same data) —, and
that the RAM tier left no shared memory behind (its root is this test's folder, not /dev/shm),
and that each kill's restart timeline has every mark (torchrun's agent lines, the survivor's exit,
the new process's phases) and adds up to the measured restart + restore. The node-loss kind (network
namespaces, root) is left to the full benchmark: it adds two relaunches per configuration. It takes 70-90 s on
the 2 shared cores (6 jobs of a few seconds each, most of it process start-up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from goodput_timeline import INFO, SEGMENTS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "bench_goodput.py"
SAVE_EVERY = 5
TINY = ["--layers", "1", "--dim", "64", "--seq", "16", "--batch", "2", "--vocab", "512", "--steps", "60",
        "--save-every", str(SAVE_EVERY), "--interval", "1", "--max-failures", "1", "--hold-for-failures",
        "--timeout", "240", "--mtbf-prior-hours", "0.001"]
"""``--hold-for-failures``: a job waits before its last steps until its failure is on its way, so that a loaded
machine (the harness slow to see the steps) never lets a job finish first (run 14 of 2026-11-30). The auto
configurations' prior, a failure every 3.6 s, makes them save within a job of a few seconds (with the library's
24 h prior, one save at the start: run 28 redid 50 of 60 steps)."""
CONFIGS = ("disk", "ram-auto", "inproc")
"""unbroken's configurations; the benchmark's peer, the DIY DCP loop, is measured by ``make bench-peers``
(benchmarks/peers/test_goodput_dcp_alone.py)."""


def test_tiny_run_injects_recovers_and_reports_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, str(SCRIPT), *TINY, "--configs", ",".join(CONFIGS), "--kinds", "kill@1,exception",
           "--one-reference", "--dir", str(work), "--json", str(out), "--plot", str(tmp_path / "goodput.png"),
           "--markdown", str(tmp_path / "goodput.md")]
    shm = tmp_path / "shm"
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", UNBROKEN_RAM_ROOT=str(shm)))
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    rows = {(r["config"], r["kind"]): r for r in doc["rows"]}
    expected = {(c, k) for c in CONFIGS for k in ("kill@1", "exception") if not (c == "inproc" and k == "kill@1")}
    expected.add((CONFIGS[0], "none"))  # --one-reference: every configuration must equal disk's uninterrupted job
    assert set(rows) == expected, set(rows) ^ expected
    for (config, kind), r in rows.items():
        assert "unavailable" not in r, r
        assert r["finished"], r  # every step of the job done
        assert 0 < r["goodput"] <= 1, r
        assert 0 < r["useful_s"] <= r["wall_s"], r
        if kind == "none":
            assert r["failures"] == 0 and r["steps_redone"] == 0 and r["exact"] is None, r
            continue
        assert r["failures"] == 1 and len(r["per_failure"]) == 1, r  # injected as asked
        (f,) = r["per_failure"]
        assert f["recovered"] and f["recovery_s"] > 0, r
        assert abs(f["restart_s"] + f["restore_s"] + f["redo_s"] - f["recovery_s"]) < 1e-6, f
        assert r["exact"] is True, r  # bitwise the uninterrupted run
        if "auto" not in config:  # auto's interval is in seconds, chosen from the prior and the saves' cost
            assert r["steps_redone"] <= SAVE_EVERY, r
        assert r["interval_s"] == 1, r  # kill@1: its own rate (here --interval's too)
        if kind == "kill@1":  # where the restart went: every segment seen, adding up to restart + restore
            (t,) = r["timeline"]
            assert set(t["segments"]) == {label for label, _ in SEGMENTS}, t
            assert abs(sum(t["segments"].values()) - f["restart_s"] - f["restore_s"]) < 1e-6, (t, f)
            assert set(t["info"]) == {label for label, _ in INFO}, t
            assert 0 < t["info"]["(kill to the survivor's exit)"] < f["restart_s"], t
    assert rows[("disk", "kill@1")]["launches"] == 1  # torchrun restarted the group itself
    for kind in ("kill@1", "exception"):  # what auto chose, kept from the run index the job's folder took along
        assert "intervals" not in rows[("disk", kind)], rows[("disk", kind)]
        chosen = rows[("ram-auto", kind)]["intervals"]
        assert chosen["save"] and all(s > 0 for s in chosen["save"]), chosen
    assert "save interval s: first -> last" in (tmp_path / "goodput.md").read_text()
    assert (tmp_path / "goodput.png").stat().st_size > 0
    assert list(work.iterdir()) == [], "the benchmark left its jobs behind"
    assert shm.is_dir() and list(shm.iterdir()) == []  # used (the tier made it), then emptied at close


RACE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from pathlib import Path
import torch.distributed as dist
from goodput_worker import Events, FaultPlan, InjectedFault

dist.init_process_group("gloo")
rank, out = dist.get_rank(), Path(sys.argv[1])
plan, events = FaultPlan(out, rank), Events(out, rank)
dist.barrier()
if rank == 1:  # rank 0 is inside its check of step 5 (the file not there yet) when the file appears
    time.sleep(2)
    (out / "fault-at").write_text("5")
try:
    plan.check(5, events, 100)
    print(f"rank {rank} ran step 5", flush=True)
except InjectedFault:
    print(f"rank {rank} raised at step 5", flush=True)
dist.destroy_process_group()
"""


def test_one_reference_serves_every_unbroken_configuration_of_a_package_and_each_dcp_its_own() -> None:
    from bench_goodput import references

    configs = ["dcp", "ram-auto", "disk@10", "warm-auto", "dcp@25", "disk-base", "ram-base"]
    assert references(configs, one=False) == {c: c for c in configs}
    assert references(configs, one=True) == {"dcp": "dcp", "ram-auto": "ram-auto", "disk@10": "ram-auto",
                                             "warm-auto": "ram-auto", "dcp@25": "dcp@25", "disk-base": "disk-base",
                                             "ram-base": "disk-base"}


def test_a_kind_carries_its_own_rate() -> None:
    from bench_goodput import rate_of

    assert rate_of("kill", 60.0) == ("kill", 60.0) and rate_of("kill@600", 60.0) == ("kill", 600.0)
    assert rate_of("node@1.5", 60.0) == ("node", 1.5) and rate_of("none", 60.0) == ("none", 60.0)
    for bad in ("none@60", "kill@0", "kill@-1", "crash@60", "kill@x"):
        with pytest.raises(ValueError):
            rate_of(bad, 60.0)


def test_an_exception_asked_for_between_two_ranks_checks_of_a_step_fires_on_both(tmp_path: Path) -> None:
    """The benchmark's injected exception is one decision of every rank: rank 0 checks step 5 before the
    fault file exists, rank 1 after it was written, and both raise at step 5 (rank 0 alone ran on
    before, the unrecoverable case that hung the suite's run 3 of 2026-11-29)."""
    import jobs

    script = tmp_path / "race.py"
    script.write_text(RACE)
    code, out = jobs.run(jobs.torchrun(2, script, str(tmp_path), str(REPO / "benchmarks")),
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert code == 0, out
    assert "rank 0 raised at step 5" in out and "rank 1 raised at step 5" in out, out
