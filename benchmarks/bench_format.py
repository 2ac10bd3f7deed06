"""unbroken's own safetensors writer and reader against the ``safetensors`` library.

Why this exists: unbroken writes and parses the safetensors format itself
(``src/unbroken/format/tensorfile.py``). This measures whether the library would be
faster for the same job, which is **write a file durably and know its checksum**, and
**load a file whose checksum was verified, with every byte of every tensor touched**.

Rows (all fsync their file; every checksum is xxh3-128 over the file's bytes):

* write, ``unbroken``: ``write_tensor_file`` streams each tensor's memory into the file
  and into the hasher in one pass (the checksum is of the bytes written).
* write, ``safetensors+hash``: ``safetensors.torch.save_file``, then the file is hashed
  by reading it back from the page cache (the only way to know the checksum of the bytes
  the library wrote).
* write, ``safetensors+hash tensors``: ``save_file``, and the header and tensors are hashed
  from memory (what the file should contain; not proof of what was written).
* read, ``unbroken``: ``LocalStore``'s reader (a private mapping hashed piece by piece)
  and ``load_tensor_file`` (validated header, views of the verified bytes).
* read, ``safetensors load_file+hash``: hash the file, then ``safetensors.torch.load_file``
  (mmap-backed tensors; the bytes hashed and the bytes loaded are read separately).
* read, ``safetensors load(bytes)``: read the file into memory, hash it, then
  ``safetensors.torch.load(bytes)`` (copies every tensor out of the bytes).

The page cache is dropped before every phase (root), every phase runs in a fresh
subprocess, round robin, ``--reps`` times; medians are printed.

    python benchmarks/bench_format.py [--mb 800] [--reps 3] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch
import xxhash

from unbroken.format.tensorfile import TensorEntry, load_tensor_file, write_tensor_file
from unbroken.store.readfile import read_file

WRITES = ["unbroken", "safetensors+hash", "safetensors+hash tensors"]
READS = ["unbroken", "safetensors load_file+hash", "safetensors load(bytes)"]


def tensors(mb: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = int(mb * 1e6 / 4 / 64)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(64)}


def drop_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def hash_file(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def do_write(method: str, mb: float, path: Path) -> float:
    ts = tensors(mb)
    drop_cache()
    t0 = time.perf_counter()
    if method == "unbroken":
        h = xxhash.xxh3_128()
        with open(path, "wb") as f:
            write_tensor_file(f, [TensorEntry(k, v) for k, v in ts.items()], h.update)
            f.flush()
            os.fsync(f.fileno())
    else:
        safetensors.torch.save_file(ts, str(path))
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        if method == "safetensors+hash":
            hash_file(path)
        else:
            h = xxhash.xxh3_128()
            for v in ts.values():
                h.update(v.numpy().data)
    return time.perf_counter() - t0


def touch(ts: dict[str, torch.Tensor]) -> None:
    for v in ts.values():
        v.view(torch.uint8)[::4096].sum()


def do_read(method: str, path: Path) -> float:
    drop_cache()
    t0 = time.perf_counter()
    if method == "unbroken":
        h = xxhash.xxh3_128()
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            buf = read_file(dfd, path.name, path.stat().st_size, 0, h)
        finally:
            os.close(dfd)
        h.hexdigest()
        table = load_tensor_file(buf, path.name)
        ts = {k: table[k] for k in table}
    elif method == "safetensors load_file+hash":
        hash_file(path)
        ts = safetensors.torch.load_file(str(path))
    else:
        with open(path, "rb") as f:
            raw = f.read()
        xxhash.xxh3_128(raw).hexdigest()
        ts = safetensors.torch.load(raw)
    touch(ts)
    return time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    path = Path(args.path)
    secs = do_write(args.method, args.mb, path) if args.phase == "write" else do_read(args.method, path)
    print(json.dumps({"s": secs}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=800.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="")
    ap.add_argument("--method", default="")
    ap.add_argument("--path", default="")
    args = ap.parse_args()
    if args.child:
        return child(args)
    root = Path(tempfile.mkdtemp(prefix="bench-format-", dir=args.dir))
    runs: dict[str, list[float]] = {f"write {m}": [] for m in WRITES} | {f"read {m}": [] for m in READS}

    def sub(phase: str, method: str, path: Path) -> float:
        out = subprocess.run([sys.executable, __file__, "--child", "--phase", phase, "--method", method,
                              "--path", str(path), "--mb", str(args.mb)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["s"]

    try:
        for _ in range(args.reps):
            for m in WRITES:
                p = root / "w.safetensors"
                runs[f"write {m}"].append(sub("write", m, p))
                p.unlink()
            p = root / "r.safetensors"
            sub("write", "unbroken", p)
            for m in READS:
                runs[f"read {m}"].append(sub("read", m, p))
            p.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{args.mb:.0f} MB in 64 fp32 tensors, median of {args.reps}, cold cache")
    for phase, methods in (("write", WRITES), ("read", READS)):
        base = med[f"{phase} unbroken"]
        for m in methods:
            k = f"{phase} {m}"
            print(f"  {k:<38} {med[k]:6.3f} s   {med[k] / base:5.2f} x unbroken   "
                  f"runs {[round(x, 3) for x in runs[k]]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"mb": args.mb, "median_s": med, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
