"""Training from a stream of records (sharded JSONL files) that resumes by byte offset.

    python examples/iterable_data.py --data-dir runs/stream-data --run-dir runs/stream --steps 300

An iterable dataset cannot be indexed, so "skip the first million records" would mean
reading them again. ``unbroken.data.JsonlReader`` instead keeps ``(shard, byte offset)``
in the checkpoint: a resume is one ``seek``, at any position. Put the reader in the
state like the model; the records the loop consumed since the last checkpoint are read
again after a kill, exactly as the steps that used them are trained again.

The first run writes a few synthetic shards into ``--data-dir`` (4 x 500 records). The
reader loops over them (``loop=True``), so the run crosses shard and epoch boundaries.
Kill it at any moment and run it again: the per-step losses and the last line
(``final loss ... sha256 ...``) are bitwise those of an uninterrupted run.

Other iterables: ``unbroken.data.Counted(source)`` counts what the loop consumed and, on
resume, calls ``source.skip(n)`` if the source has one (else it replays, with a warning);
an iterable with its own ``state_dict()``/``load_state_dict()`` goes into the state as is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import torch

import unbroken
import unbroken.data

SHARDS, PER_SHARD, FEATURES, CLASSES = 4, 500, 8, 3


def write_shards(data_dir: Path) -> list[Path]:
    """Deterministic synthetic shards (written once; a real job points at its own files)."""
    paths = [data_dir / f"part-{s:05d}.jsonl" for s in range(SHARDS)]
    if all(p.exists() for p in paths):
        return paths
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    k = 0
    for p in paths:
        lines = []
        for _ in range(PER_SHARD):
            x = [rng.gauss(0.0, 1.0) for _ in range(FEATURES)]
            y = (x[0] > 0) + (x[1] + x[2] > 0.5)  # 0, 1 or 2
            lines.append(json.dumps({"id": k, "x": x, "y": int(y)}) + "\n")
            k += 1
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(lines))
        tmp.rename(p)
    return paths


def fingerprint(*objs) -> str:
    """sha256 of every tensor in the state dicts of ``objs``."""
    h = hashlib.sha256()
    for obj in objs:
        for t in _tensors(obj.state_dict()):
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, dict):
        for k in sorted(v, key=str):
            yield from _tensors(v[k])
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="runs/stream-data")
    p.add_argument("--run-dir", default="runs/stream")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--save-every", type=int, default=25)
    args = p.parse_args(argv)

    paths = write_shards(Path(args.data_dir))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    reader = unbroken.data.JsonlReader(paths, loop=True)  # (shard, byte offset) goes into the checkpoint
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=2)
    state = {"model": model, "optimizer": opt, "data": reader}
    info = ckpt.restore(state)
    pos = reader.state_dict()
    print(f"resumed from step {info.step} at record {pos['records']} (shard {pos['shard_name']}, "
          f"byte {pos['offset']}, epoch {pos['epoch']})" if info else "fresh start", flush=True)

    records = iter(reader)  # after a restore: opens the saved shard and seeks to the saved offset
    while ckpt.progress.step < args.steps:
        batch = [next(records) for _ in range(args.batch_size)]  # loop=True: the stream never ends
        x = torch.tensor([r["x"] for r in batch])
        y = torch.tensor([r["y"] for r in batch])
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)  # the reader's position is exactly "after this batch"
        print(f"step {ckpt.progress.step} loss {loss.item()!r} records {batch[0]['id']}-{batch[-1]['id']}",
              flush=True)

    ckpt.close()
    print(f"final records {reader.state_dict()['records']} sha256 {fingerprint(model, opt)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
