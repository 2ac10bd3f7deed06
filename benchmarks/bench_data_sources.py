"""What exactness costs for the data of docs/data.md: HF streams, mixtures, packing.

* **Stream throughput**: examples/s over a ``datasets.IterableDataset`` (``from_generator``, 8
  shards, ``--examples`` small text examples, a ``.map``), plain ``DataLoader`` vs
  ``unbroken.data.StreamLoader``, 0 and 2 workers, without and with ``.shuffle(buffer_size=1000)``.
* **Stream resume**: ``load_state_dict`` to the first batch at 10,000 examples in (buffer 1000),
  and the size of the loader's state in a checkpoint (``unbroken.save``, the buffer's examples
  included).
* **Mixture**: time per sample of ``Mixture.locate`` (3 sources of 10^6, block 1024), the first
  batch after a resume at sample 10^3 and 10^9 through ``mix.loader``, and a weight change at resume.
* **Packer**: packing throughput (tokens/s) and the carry's size.

    python benchmarks/bench_data_sources.py [--examples 20000] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import unbroken
import unbroken.data as ud

N_SHARDS = 8


def gen(shards, per):
    for s in shards:
        for j in range(per):
            yield {"id": s * per + j, "text": f"example {s}-{j} " + "lorem ipsum " * 8}


def stream(n: int, buffer: int):
    from datasets import IterableDataset

    ds = IterableDataset.from_generator(gen, gen_kwargs={"shards": list(range(N_SHARDS)), "per": n // N_SHARDS})
    ds = ds.map(lambda ex: {"length": len(ex["text"])})
    return ds.shuffle(seed=0, buffer_size=buffer) if buffer else ds


def collate(rows):
    return [r["id"] for r in rows]


def rate(make, n: int) -> float:
    t = time.perf_counter()
    seen = sum(len(b) for b in make())
    assert seen == n, (seen, n)
    return n / (time.perf_counter() - t)


def median(fn, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def bench_streams(n: int) -> list[str]:
    rows = ["| workers | shuffle buffer | DataLoader (examples/s) | StreamLoader (examples/s) | ratio |",
            "|---|---|---|---|---|"]
    for workers in (0, 2):
        for buffer in (0, 1000):
            ds = stream(n, buffer)
            plain = rate(lambda ds=ds, workers=workers: DataLoader(ds, batch_size=32, num_workers=workers,
                                                                   collate_fn=collate), n)
            ours = rate(lambda ds=ds, workers=workers: ud.StreamLoader(ds, batch_size=32, num_workers=workers,
                                                                       collate_fn=collate), n)
            rows.append(f"| {workers} | {buffer or '-'} | {plain:,.0f} | {ours:,.0f} | {ours / plain:.2f} |")
    return rows


def bench_stream_resume(n: int, tmp: Path) -> list[str]:
    ds = stream(n, 1000)
    loader = ud.StreamLoader(ds, batch_size=32, num_workers=2, collate_fn=collate)
    it = iter(loader)
    for _ in range(10_000 // 32):
        next(it)
    state = copy.deepcopy(loader.state_dict())
    del it
    unbroken.save(tmp / "ckpt", {"data": loader})
    size = sum(f.stat().st_size for f in (tmp / "ckpt").rglob("*") if f.is_file())

    def first_batch():
        again = ud.StreamLoader(ds, batch_size=32, num_workers=2, collate_fn=collate)
        again.load_state_dict(copy.deepcopy(state))
        next(iter(again))

    t = median(first_batch, 3)
    return [f"- resume at example 10,000 (2 workers, buffer 1000: {len(state['buffer']['items'])} examples held): "
            f"first batch {t * 1e3:.0f} ms after `load_state_dict`; the loader's checkpoint "
            f"{size / 1e3:.0f} kB"]


class Big(Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i):
        return int(i)


def bench_mixture() -> list[str]:
    sources = {"web": Big(), "code": Big(), "math": Big()}
    schedule = [(0, {"web": .7, "code": .2, "math": .1}), (10**6, {"web": .5, "code": .3, "math": .2})]
    mix = ud.Mixture(sources, schedule, seed=0)
    t = time.perf_counter()
    for g in range(100_000):
        mix.locate(g)
    per = (time.perf_counter() - t) / 100_000
    out = [f"- `Mixture.locate`: {per * 1e6:.1f} µs per sample "
           "(3 sources of 10^6, block 1024, amortized over the block)"]
    for pos in (10**3, 10**9):
        loader = mix.loader(batch_size=32)
        state = {**loader.state_dict(), "position": pos, "samples_seen": pos}

        def first(state=state):
            fresh = ud.Mixture(sources, schedule, seed=0).loader(batch_size=32)
            fresh.load_state_dict(copy.deepcopy(state))
            next(iter(fresh))

        out.append(f"- first batch after a resume at sample {pos:.0e}: {median(first) * 1e3:.1f} ms")
    state = {**mix.loader(batch_size=32).state_dict(), "position": 10**9 + 5, "samples_seen": 10**9 + 5}

    def changed():
        fresh = ud.Mixture(sources, {"web": .4, "code": .4, "math": .2}, seed=0).loader(batch_size=32)
        fresh.load_state_dict(copy.deepcopy(state))
        next(iter(fresh))

    import logging

    logging.getLogger("unbroken").setLevel(logging.ERROR)
    out.append("- the same with other weights at resume (a new phase from the next block): "
               f"{median(changed) * 1e3:.1f} ms")
    return out


def bench_packer() -> list[str]:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 32000, (int(n),), generator=g).tolist()
            for n in torch.randint(50, 2000, (2000,), generator=g)]
    packer = ud.Packer(seq_len=2048, batch_size=8)
    t = time.perf_counter()
    for i in range(0, len(docs), 16):
        packer(docs[i:i + 16])
    took = time.perf_counter() - t
    tokens = sum(map(len, docs))
    return [f"- `Packer` (seq_len 2048, 8 rows): {tokens / took / 1e6:.1f} M tokens/s; its carry is under one batch "
            f"({len(packer.tokens):,} tokens now, 16 bytes each in the checkpoint: ids and positions)"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=20_000)
    p.add_argument("--markdown", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    import datasets

    head = [f"Measured on {platform.machine()} with {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch.__version__}, datasets {datasets.__version__}.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        lines = (head + ["Streams:", ""] + bench_streams(args.examples) + [""]
                 + bench_stream_resume(args.examples, Path(tmp)))
    lines += ["", "Mixtures:", ""] + bench_mixture() + ["", "Packing:", ""] + bench_packer()
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
