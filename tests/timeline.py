"""Read a suite's timeline (``UNBROKEN_TEST_TIMELINE=<file> make test``; tests/conftest.py writes one
line per test: worker, start, end, node id) and print where the time went: the wall time, each
worker's busy time and when it went idle, and the scopes (files, or the groups the scheduler splits
some files into) with the time their tests took, longest first. ``--table`` prints the scopes as the
``MEASURED_S`` table of tests/conftest.py, which orders the work longest first (docs/testing.md).

    python tests/timeline.py /tmp/timeline.tsv [--top 30] [--table]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

SPLIT_BY = {"test_integration_hf_dist.py", "test_integration_lightning_dist.py"}
"""The longest files, whose tests form one scope per parameter value (the stack, the strategy: the first
part of the test's id in brackets). Each value has its own reference run, so the scopes share nothing and
run on different workers; kept whole, either file ran alone on one worker for the last stretch."""


FOUR_RANKS = {"test_ddp_align.py", "test_integration_hf_ddp4.py", "test_integration_lightning_ddp4.py"}
"""The files whose jobs start 4 ranks (5 processes on 2 cores): one scope, so that two such jobs never run
beside each other (each is slow enough alone to come near its collectives' timeouts under load)."""


def scope(nodeid: str) -> str:
    """The scheduling scope of a test: its file, for :data:`SPLIT_BY` its file and parameter value
    (``tests/test_integration_hf_dist.py[fsdp2]``), for :data:`FOUR_RANKS` one scope of them all."""
    file = nodeid.split("::", 1)[0]
    if Path(file).name in FOUR_RANKS:
        return str(Path(file).parent / "4-ranks")
    if Path(file).name in SPLIT_BY and nodeid.endswith("]"):
        return f"{file}[{nodeid.rsplit('[', 1)[1].split('-')[0].rstrip(']')}]"
    return file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--table", action="store_true", help="print the MEASURED_S table for tests/conftest.py")
    args = ap.parse_args()
    rows = [line.rstrip("\n").split("\t") for line in args.timeline.read_text().splitlines() if line.strip()]
    t0 = min(float(r[1]) for r in rows)
    end = max(float(r[2]) for r in rows)
    busy: dict[str, float] = collections.defaultdict(float)
    last: dict[str, float] = {}
    took: dict[str, float] = collections.defaultdict(float)
    span: dict[str, tuple[float, float, str]] = {}
    for worker, start, stop, nodeid in rows:
        s, e = float(start) - t0, float(stop) - t0
        busy[worker] += e - s
        last[worker] = max(last.get(worker, 0.0), e)
        key = Path(scope(nodeid)).name
        took[key] += e - s
        first = span.get(key, (s, e, worker))
        span[key] = (min(first[0], s), max(first[1], e), worker)
    if args.table:
        print("MEASURED_S = {")
        for key, secs in sorted(took.items(), key=lambda kv: -kv[1]):
            if secs >= 20:
                print(f'    "{key}": {secs:.0f},')
        print("}")
        return
    print(f"{len(rows)} tests, {(end - t0) / 60:.1f} min from the first test's start to the last test's end")
    for worker in sorted(busy):
        print(f"  {worker}: busy {busy[worker] / 60:5.1f} min, last test ended at minute {last[worker] / 60:5.1f}")
    total = sum(busy.values())
    print(f"  the tests' time over {len(busy)} workers: {total / 60 / len(busy):.1f} min each if shared evenly")
    print(f"\n{'minutes':>7}  {'from':>5}-{'to':<5} worker  scope")
    for key, secs in sorted(took.items(), key=lambda kv: -kv[1])[:args.top]:
        s, e, worker = span[key]
        print(f"{secs / 60:7.1f}  {s / 60:5.1f}-{e / 60:<5.1f} {worker:6}  {key}")


if __name__ == "__main__":
    main()
