"""DDP under torchrun (gloo, CPU): every rank runs the same loop, unbroken makes them agree.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --run-dir runs/ddp --steps 100
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/torchrun_ddp.py ...  # restart on a crash

Each rank creates the same ``Checkpointer`` on the same run folder (a shared filesystem
or an object store). The DDP model and its optimizer are replicated, so they are written
once (their files split over the ranks); every rank's RNG states are saved per rank;
rank 0 commits the checkpoint only after every rank wrote its part. The ranks save the
same steps and, on SIGTERM/SIGUSR1 to any rank, all stop after the same step.

``kill -9`` one rank: with ``--max-restarts`` torchrun stops the other, starts both again,
and every rank resumes from the newest checkpoint (without it, run the same command
again). The result is bitwise that of an uninterrupted run. Each rank prints ``step``
lines with its own loss (its own slice of the data) and, at the end, a sha256 of its
parameters and optimizer state, the same on every rank.

``unbroken.init_distributed()`` is ``init_process_group`` made safe for torchrun restarts
(see docs/distributed.md). Use ``"nccl"`` and ``.cuda()`` on GPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import unbroken
import unbroken.data


class Blobs(Dataset):
    """A fixed synthetic classification set: 4 noisy clusters in 16 dimensions."""

    def __init__(self, n: int = 2048) -> None:
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(4, 16, generator=g) * 0.5
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, 16, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        g = i.generator()  # keyed by (seed, epoch, index): the same on any rank, after any resume
        return self.x[i] + 0.1 * torch.randn(16, generator=g), self.y[i]


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of the parameters and the optimizer's tensors."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for _, st in sorted(opt.state_dict()["state"].items()):
        for _, t in sorted(st.items()):
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def say(line: str) -> None:
    """One write per line: the ranks share stdout, and print() may write the newline separately."""
    print(line + "\n", end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/ddp")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    args = p.parse_args(argv)

    unbroken.init_distributed("gloo")  # reads RANK, WORLD_SIZE, MASTER_ADDR... set by torchrun
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
    # rank and world size come from torch.distributed: rank r takes the r-th slice of each global batch
    loader = unbroken.data.ResumableLoader(Blobs(), batch_size=args.batch_size, shuffle=True, seed=0)

    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=3)  # the same on every rank
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}
    info = ckpt.restore(state)
    say(f"rank {rank}: " + (f"resumed from step {info.step}" if info else "fresh start"))

    while ckpt.progress.step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients over the ranks here
            opt.step()
            sched.step()
            opt.zero_grad()
            ckpt.step(state, loss=loss)  # the ranks agree on saving (and on preemption) at every step
            say(f"rank {rank} step {ckpt.progress.step} loss {loss.item()!r}")
            if ckpt.progress.step >= args.steps:
                break

    ckpt.close()
    say(f"rank {rank}: done, sha256 {fingerprint(model.module, opt)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit("run me under torchrun: torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py")
    sys.exit(main())
