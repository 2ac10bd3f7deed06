"""The job of tests/dist_train.py checkpointed by PyTorch alone, as its DDP tutorial does it.

    torchrun --nnodes 2 ... benchmarks/peers/multinode_alone_train.py --run-dir RUN --out OUT --global-batch 16

The same model, optimizer, schedule and data (with a per-sample augmentation seeded by the index)
as dist_train.py, a ``DistributedSampler`` (shuffled, seeded), and the snapshot of PyTorch's
"multinode DDP" tutorial: rank 0 writes ``torch.save({model, optimizer, scheduler, step})`` to
``RUN/snapshot.pt`` every ``--save-every`` steps (in place), and every process loads it at start
and skips the batches of the epoch already done. Signals keep their default action. Each rank
appends ``{"step", "loss", "samples"}`` rows to ``OUT/losses-r<rank>.jsonl``, as dist_train.py does.

Test hooks: ``MULTINODE_FREEZE_IN_SAVE=N``: rank 0 stops itself (SIGSTOP) half-way through writing
the N-th snapshot of this process (the test then loses its node there); ``MULTINODE_STOP_AFTER=N``:
the process stops itself right after step N (the test then knows where the job is).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the jobs of the tests it measures against
from dist_train import Data, model_and_optimizer


class AloneData(Data):
    def __getitem__(self, i):  # the same augmentation, drawn from a generator seeded by the index
        noise = torch.randn(self.x.shape[1], generator=torch.Generator().manual_seed(int(i))) * 0.1
        return self.x[i] + noise, self.y[i], int(i)


def save(snapshot: dict, path: Path, freeze: bool) -> None:
    """``torch.save(snapshot, path)``; with ``freeze``, stop half-way through the file."""
    if not freeze:
        torch.save(snapshot, path)
        return
    buf = io.BytesIO()
    torch.save(snapshot, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        print(f"frozen half-way through {path.name} (pid {os.getpid()})", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        f.write(data[len(data) // 2:])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    run, out = Path(args.run_dir), Path(args.out)
    run.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    model, opt, sched = model_and_optimizer("ddp")
    data = AloneData()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler)
    per_epoch, step = len(loader), 0
    snapshot = run / "snapshot.pt"
    if snapshot.exists():
        saved = torch.load(snapshot, weights_only=True)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        step = saved["step"]
        print(f"rank {rank}: resumed from step {step}", flush=True)
    freeze_at, saves = int(os.environ.get("MULTINODE_FREEZE_IN_SAVE", "0")), 0
    stop_after = int(os.environ.get("MULTINODE_STOP_AFTER", "0"))
    with open(out / f"losses-r{rank}.jsonl", "a") as log:
        while step < args.steps:
            sampler.set_epoch(step // per_epoch)
            for i, (x, y, idx) in enumerate(loader):
                if i < step % per_epoch:
                    continue  # done before the snapshot
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                step += 1
                log.write(json.dumps({"step": step, "loss": loss.item(), "samples": idx.tolist()}) + "\n")
                log.flush()
                print(f"rank {rank} step {step}", flush=True)
                if rank == 0 and step % args.save_every == 0:
                    saves += 1
                    save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                          "scheduler": sched.state_dict(), "step": step}, snapshot, saves == freeze_at)
                if step == stop_after:
                    print(f"stopped after step {step} (pid {os.getpid()})", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                if step >= args.steps:
                    break
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
