"""The cost of ``ckpt.step()`` at several ranks when no save is due: the ranks' agreement.

Each rank of a torchrun job (gloo, CPU) runs ``--steps`` steps of "compute" (a sleep of
``--compute`` ms plus a per-rank random ``0..--jitter`` ms, as ranks of a real job finish
their steps at slightly different times: data loading, logging, stragglers), an optional
``--sync`` all-reduce on the default group (DDP's gradient all-reduce: it lines the ranks up
once per step), then ``ckpt.step(state)`` with a Checkpointer that has no save due
(``save_every`` above ``--steps``; the default preemption signals watched). Reported per rank:
the mean and median time inside ``ckpt.step()`` and the mean wall time per step, over the steps
after ``--warmup``. Sleeping, not computing, keeps the numbers stable on a shared machine.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/bench_step_agreement.py \\
        [--steps 300] [--compute 20] [--jitter 10] [--sync]

Compare two versions by running it with ``PYTHONPATH`` pointing at each one's ``src``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import unbroken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--compute", type=float, default=20.0, help="ms of compute per step (a sleep)")
    ap.add_argument("--jitter", type=float, default=10.0, help="up to this many ms more, random per rank and step")
    ap.add_argument("--sync", action="store_true", help="an all-reduce per step before ckpt.step (as DDP's)")
    a = ap.parse_args()
    unbroken.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rng = random.Random(rank)
    grad = torch.zeros(1024)
    run = tempfile.mkdtemp(prefix="bench-step-agreement-") if rank == 0 else ""
    objs = [run]
    dist.broadcast_object_list(objs, src=0)
    state = {"model": torch.nn.Linear(4, 4)}
    ckpt = unbroken.Checkpointer(objs[0], save_every=10 * a.steps, keep_last=1)
    inside, walls = [], []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        time.sleep((a.compute + a.jitter * rng.random()) / 1e3)
        if a.sync:
            dist.all_reduce(grad)
        t1 = time.perf_counter()
        ckpt.step(state)
        t2 = time.perf_counter()
        if i >= a.warmup:
            inside.append(t2 - t1)
            walls.append(t2 - t0)
    ckpt.close()
    row = {"rank": rank, "world": world, "unbroken": unbroken.__file__, "steps": a.steps, "compute_ms": a.compute,
           "jitter_ms": a.jitter, "sync": a.sync, "step_mean_ms": 1e3 * statistics.mean(inside),
           "step_median_ms": 1e3 * statistics.median(inside), "wall_per_step_ms": 1e3 * statistics.mean(walls)}
    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
