"""Quickstart: the training loop from README.md, runnable. Kill it, run it again, same result.

    python examples/quickstart.py --run-dir runs/quickstart --steps 200

Press Ctrl-C (it saves and exits with status 75) or `kill -9` it at any moment, then
run the same command again: it continues from the newest valid checkpoint and ends
with bitwise the same parameters as a run that was never interrupted. The last line,
``final loss ... sha256 ...``, fingerprints the final parameters and optimizer state
so that two runs can be compared.

Everything here is a toy (a small MLP, a synthetic dataset, CPU); the lines marked
``+N`` are the ones unbroken adds to a loop.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
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
        g = i.generator()  # per-sample randomness keyed by (seed, epoch, index): resumes exactly
        return self.x[i] + 0.1 * torch.randn(16, generator=g), self.y[i]


def fingerprint(*objs) -> str:
    """sha256 of every tensor in the state dicts of ``objs`` (parameters, optimizer moments)."""
    h = hashlib.sha256()

    def walk(v):
        if isinstance(v, torch.Tensor):
            h.update(v.detach().contiguous().numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:  # numbers, strings, None: the learning rate, the scheduler's counters
            h.update(repr(v).encode())

    for obj in objs:
        walk(obj.state_dict())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/quickstart")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (any number resumes)")
    args = p.parse_args(argv)
    total_steps = args.steps

    torch.manual_seed(0)  # the initial weights; a resume overwrites them with the checkpoint's
    dataset = Blobs()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # float32 on CPU: off, but a scaler is state too

    # ---- the README's loop ------------------------------------------------------------------
    loader = unbroken.data.ResumableLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=args.workers)  # +1
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=3)                 # +2
    state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "data": loader}  # +3
    info = ckpt.restore(state)             # +4  newest *valid* checkpoint, or a fresh start
    print(f"resumed from step {info.step}" if info else "fresh start", flush=True)

    loss = None
    while ckpt.progress.step < total_steps:
        for x, y in loader:                #     continues mid-epoch after a restore: nothing replayed
            loss = loss_fn(model(x), y)
            loss.backward(); opt.step(); sched.step(); opt.zero_grad()  # noqa: E702
            ckpt.step(state, loss=loss)    # +5  saves every --save-every steps, atomically
            print(f"step {ckpt.progress.step} loss {loss.item()!r}", flush=True)
            if ckpt.progress.step >= total_steps:
                break
    # ------------------------------------------------------------------------------------------

    ckpt.close()  # releases the run (a `with unbroken.Checkpointer(...) as ckpt:` block does it too)
    final = "(the run was already complete)" if loss is None else repr(loss.item())
    print(f"final loss {final} sha256 {fingerprint(model, opt, sched)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
