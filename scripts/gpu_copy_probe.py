"""Where a GPU save's stall goes: raw device-to-host copies into pinned and pageable memory against
unbroken's staging (``Snapshotter(copy=True).capture`` + ``complete``), and a RAM-tier write of the
same snapshot to /dev/shm split into its parts. Run on a CUDA machine: ``python3 scripts/gpu_copy_probe.py``."""

import os
import shutil
import tempfile
import time

import torch
import xxhash

from unbroken.checkpoint.persist import write_snapshot
from unbroken.checkpoint.snapshot import Snapshotter
from unbroken.store import open_store


def timed(fn, reps=3):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return min(out), out


ts = [torch.randn(4 << 20, device="cuda") for _ in range(38)]  # 38 x 16 MiB = 637 MB
nbytes = sum(t.numel() * 4 for t in ts)
pinned = [torch.empty(t.shape, pin_memory=True) for t in ts]
pageable = [torch.empty(t.shape) for t in ts]
for name, bufs in (("pinned", pinned), ("pageable", pageable)):
    best, all_ = timed(lambda bufs=bufs: [b.copy_(t, non_blocking=True) for b, t in zip(bufs, ts, strict=True)])
    print(f"raw D2H {name}: {best:.4f} s = {nbytes / best / 1e9:.1f} GB/s  {[round(x, 4) for x in all_]}")
snap = Snapshotter(copy=True)
state = {"m": {f"t{i}": t for i, t in enumerate(ts)}}
best, all_ = timed(lambda: snap.capture(state).complete())
print(f"Snapshotter capture+complete: {best:.4f} s = {nbytes / best / 1e9:.1f} GB/s  {[round(x, 4) for x in all_]}")
s0 = snap.capture(state)
s0.complete()
root = tempfile.mkdtemp(dir="/dev/shm")
store = open_store(root)
for i in range(3):
    s = snap.capture(state)
    s.complete()
    t = time.perf_counter()
    write_snapshot(s, store, f"step-{i:09d}", step=i, seq=i)
    print(f"write_snapshot to /dev/shm #{i}: {time.perf_counter() - t:.4f} s")
t = time.perf_counter()
for p in pinned:
    xxhash.xxh3_128(memoryview(p.numpy())).hexdigest()
print(f"xxh3 of {nbytes / 1e6:.0f} MB: {time.perf_counter() - t:.4f} s")
shutil.rmtree(root)
# the tmpfs part: the same bytes into fresh files (new pages) and again into the same files (pages reused)
root = tempfile.mkdtemp(dir="/dev/shm")
for label, flags in (("fresh files", os.O_CREAT | os.O_WRONLY | os.O_TRUNC), ("same files, in place", os.O_WRONLY)):
    for r in range(2):
        t = time.perf_counter()
        for i, p in enumerate(pinned):
            fd = os.open(f"{root}/f{i}" if label != "fresh files" else f"{root}/f{i}-{r}" if r else f"{root}/f{i}",
                         flags)
            os.write(fd, memoryview(p.numpy()).cast("B"))
            os.close(fd)
        print(f"tmpfs write, {label} #{r}: {time.perf_counter() - t:.4f} s")
shutil.rmtree(root)
