"""Time to resume the data stream at sample 10^3, 10^6 and 10^9: unbroken vs replay.

Map-style data: a virtual dataset of ``N`` = 4e9 samples that allocates nothing
(``__getitem__`` builds an 8-float tensor from the index), batch size ``--batch-size``
(32), one process, ``num_workers=0``.

* ``unbroken``: ``ResumableLoader(shuffle=True)``; time from ``load_state_dict`` (a
  state at position ``p``) to the first batch in hand, median of ``--reps``. Also
  ``GlobalOrder.indices`` for one batch at ``p`` (what the resume computes).
* ``replay, load``: a plain ``DataLoader`` whose batches are loaded and discarded
  until ``p`` (Composer's mid-epoch resume; accelerate's ``skip_first_batches`` for
  iterable datasets).
* ``replay, indices``: the batch sampler's index lists are walked and discarded, no
  data loaded (accelerate's ``SkipBatchSampler``, its ``skip_first_batches`` for
  map-style datasets): the cheapest replay there is.

Both replays use a ``SequentialSampler`` (a ``RandomSampler`` would first need a 32 GB
``randperm`` of 4e9 int64), so they are a lower bound for a shuffled run. Replay skips
``p // batch`` batches. At 10^9 it is not run: the per-batch rate measured at 10^6
times the batches, marked "(extrapolated)".

Streaming data: a generated JSONL file (``--jsonl-lines``, 10^6) in a temp dir.
``JsonlReader.load_state_dict`` (one seek to the saved byte offset) vs replay (the
first ``p`` records read, parsed and discarded: what ``Counted`` does for a source
without ``skip``), each to the first batch of records.

    python benchmarks/bench_data_resume.py [--batch-size 32] [--reps 20] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from unbroken.data import GlobalOrder, JsonlReader, ResumableLoader

N = 4_000_000_000
POSITIONS = (10**3, 10**6, 10**9)
REPLAY_MAX = 10**6  # replay is measured up to here and extrapolated beyond


class Virtual(Dataset):
    """``N`` samples computed from the index: nothing is stored."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(8, dtype=torch.float32) + float(i % 1_000_003)


def median_time(fn, reps: int) -> float:
    if reps > 1:
        fn()  # warm-up, not timed
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def unbroken_resume(ds: Virtual, b: int, p: int, reps: int) -> tuple[float, float]:
    loader = ResumableLoader(ds, b, shuffle=True, seed=1, num_workers=0)
    state = dict(loader.state_dict(), position=p, samples_seen=p)
    batch = None

    def resume() -> None:
        nonlocal batch
        loader.load_state_dict(state)
        batch = next(iter(loader))

    t = median_time(resume, reps)
    want = torch.stack([ds[int(i)] for i in loader.order.indices(0, p, p + b)])
    assert torch.equal(batch, want), "resumed batch is not the one at the position"
    order = GlobalOrder(N, seed=1)
    return t, median_time(lambda: order.indices(0, p, p + b), reps * 10)


def replay(ds: Virtual, b: int, p: int, load: bool) -> float:
    t = time.perf_counter()
    it = iter(DataLoader(ds, batch_size=b, sampler=SequentialSampler(ds), num_workers=0) if load
              else BatchSampler(SequentialSampler(ds), b, drop_last=False))
    for _ in range(p // b):
        next(it)
    first = next(it) if load else torch.stack([ds[i] for i in next(it)])
    t = time.perf_counter() - t
    assert torch.equal(first[0], ds[p // b * b])
    return t


def make_jsonl(path: str, lines: int) -> list[int]:
    """Write ``lines`` records; return the byte offset at which each record starts."""
    offsets, pos = [], 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            line = json.dumps({"id": i, "text": f"record {i} " + "lorem ipsum " * (i % 7),
                               "tokens": [i % 101, i % 103, i % 107]}) + "\n"
            offsets.append(pos)
            pos += len(line)
            f.write(line)
    return offsets


def jsonl_resume(path: str, offsets: list[int], b: int, p: int, reps: int) -> tuple[float, float]:
    base = JsonlReader([path]).state_dict()
    state = dict(base, offset=offsets[p], records=p)

    def seek() -> list:
        r = JsonlReader([path])
        r.load_state_dict(state)
        it = iter(r)
        return [next(it) for _ in range(b)]

    def spin() -> list:  # what Counted does for a source without skip()
        it = iter(JsonlReader([path]))
        for _ in range(p):
            next(it)
        return [next(it) for _ in range(b)]

    assert seek()[0]["id"] == p and spin()[0]["id"] == p
    return median_time(seek, reps), median_time(spin, 1 if p >= 10**5 else 3)


def fmt(s: float) -> str:
    return (f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"
            if s < 3600 else f"{s / 3600:.1f} h")


def ratio(slow: float, fast: float) -> str:
    r = slow / fast
    return f"{r:.2f}x" if r < 10 else f"{r:,.0f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--jsonl-lines", type=int, default=10**6)
    ap.add_argument("--markdown", metavar="FILE")
    a = ap.parse_args()
    b, ds = a.batch_size, Virtual()
    started, map_rows, rate = time.perf_counter(), [], {}
    for p in POSITIONS:
        t_ub, t_idx = unbroken_resume(ds, b, p, a.reps)
        cells = []
        for load in (True, False):
            if p <= REPLAY_MAX:
                t = statistics.median(replay(ds, b, p, load) for _ in range(3 if p < REPLAY_MAX else 1))
                rate[load] = t / max(1, p // b)
                cells.append((t, fmt(t)))
            else:
                t = rate[load] * (p // b)
                cells.append((t, f"{fmt(t)} (extrapolated)"))
        map_rows.append([f"{p:.0e}", fmt(t_ub), fmt(t_idx), cells[0][1], cells[1][1],
                         ratio(cells[0][0], t_ub), ratio(cells[1][0], t_ub)])
        print(f"map-style {p:.0e}: unbroken {fmt(t_ub)}, replay {cells[0][1]}", flush=True)

    jsonl_rows = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "data.jsonl")
        offsets = make_jsonl(path, a.jsonl_lines)
        size = os.path.getsize(path)
        for p in sorted(q for q in {10**3, 10**4, 10**5, a.jsonl_lines * 9 // 10} if q + b <= a.jsonl_lines):
            t_seek, t_spin = jsonl_resume(path, offsets, b, p, a.reps)
            jsonl_rows.append([f"{p:,}", fmt(t_seek), fmt(t_spin), ratio(t_spin, t_seek)])
            print(f"jsonl {p:,}: seek {fmt(t_seek)}, replay {fmt(t_spin)}", flush=True)

    env = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
           f"{platform.python_version()}, torch {torch.__version__}; batch {b}, map-style N = {N:.0e}, "
           f"JSONL {a.jsonl_lines:,} lines ({size / 1e6:.0f} MB), unbroken times median of {a.reps}; "
           f"total {time.perf_counter() - started:.0f} s")
    text = "\n\n".join([
        "Map-style: time to the first batch at position p (samples) of the epoch",
        table(["position", "unbroken resume", "GlobalOrder.indices (1 batch)", "replay, load",
               "replay, indices", "load / unbroken", "indices / unbroken"], map_rows),
        "JSONL: time to the first batch of records after resuming at record p",
        table(["position", "unbroken (seek)", "replay (read + parse)", "replay / unbroken"], jsonl_rows),
        env])
    print("\n" + text)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
