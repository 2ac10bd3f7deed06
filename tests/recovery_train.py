"""A training job for the in-process recovery tests (tests/test_recovery.py), one process or torchrun.

    python tests/recovery_train.py --run-dir RUN --out OUT --faults 7:oom,12:nan
    torchrun --standalone --nproc_per_node 2 tests/recovery_train.py --run-dir RUN --out OUT --faults 7:oom

A small MLP with dropout (the RNG matters), a shuffled ResumableLoader with per-sample augmentation,
AdamW + LambdaLR, DDP with several ranks; the loop runs inside ``ckpt.recover(train, state,
on=(torch.OutOfMemoryError, FloatingPointError))``.

Faults (``--faults step:kind[:times[:after]][@rank]``, comma-separated): at that step the job fails
``times`` times in all (default 1), not on the first ``after`` visits of the step (default 0),
counted in ``OUT/fault-*`` files so a relaunch sees how many already fired; ``@rank`` limits it to
one rank (default: every rank).

- ``oom``: ``torch.OutOfMemoryError`` from inside the forward, after the dropout drew from the RNG;
- ``realoom``: the same from a real 32 TiB allocation on the model's device (``--device cuda``);
- ``oombw``: ``torch.OutOfMemoryError`` from inside the backward (a hook of the hidden layer's
  output), after the last layer's gradients were accumulated;
- ``nan``: the loss becomes NaN; the loop all-reduces "is any loss non-finite" and every rank
  raises ``FloatingPointError`` (the global decision the README asks for);
- ``key``: ``KeyError`` from the forward (not in ``on``: must propagate);
- ``kill``: SIGKILL of this process at the start of the step.

``--spike-sample I``: a batch holding sample ``I`` multiplies its loss by 1e4 (a bad example); with
``--rollback-if`` the job passes ``rollback_if=lambda m: m["loss"] > 1e3`` and ``--skip-batches``.
Every rank appends ``{"step", "loss", "samples"}`` lines to ``OUT/losses-r<rank>.jsonl`` (re-run steps
too); at the end rank 0 writes the parameters and optimizer state to ``OUT/final.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import Dataset

import unbroken
import unbroken.data

N, D, C = 256, 8, 4


class Data(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, D, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        noise = torch.randn(D, generator=i.generator()) * 0.1  # keyed by (seed, epoch, sample)
        return self.x[i] + noise, self.y[i], int(i)


class Faults:
    def __init__(self, spec: str, out: Path, rank: int) -> None:
        self.out, self.rank, self.todo = out, rank, {}
        for item in filter(None, spec.split(",")):
            item, _, only = item.partition("@")
            step, kind, *rest = item.split(":")
            if only and int(only) != rank:
                continue
            times, after = (int(rest[0]) if rest else 1), (int(rest[1]) if len(rest) > 1 else 0)
            self.todo[(int(step), kind)] = (times, after)
        self.armed: str | None = None

    def take(self, step: int, kind: str) -> bool:
        """Whether the fault (step, kind) fires now (each firing is counted in a file)."""
        if (step, kind) not in self.todo:
            return False
        times, after = self.todo[(step, kind)]
        f = self.out / f"fault-r{self.rank}-{step}-{kind}"
        visits, fired = map(int, f.read_text().split()) if f.exists() else (0, 0)
        fire = visits >= after and fired < times
        f.write_text(f"{visits + 1} {fired + fire}")
        return fire


class Raise(torch.nn.Module):
    """Raises the armed fault in the forward; passes the input through otherwise."""

    def __init__(self, faults: Faults) -> None:
        super().__init__()
        self.faults = faults

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind, self.faults.armed = self.faults.armed, None
        if kind == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if kind == "realoom":  # a real allocation failure of the CUDA caching allocator (--device cuda)
            torch.empty(1 << 45, dtype=torch.uint8, device=x.device)
        if kind == "key":
            raise KeyError("injected")
        if kind == "oombw":
            def hook(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("CUDA out of memory in backward (injected)")
            x = x * 1.0
            x.register_hook(hook)
        return x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--faults", default="")
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--spike-sample", type=int, default=-1)
    ap.add_argument("--rollback-if", action="store_true")
    ap.add_argument("--skip-batches", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ram", action="store_true", help="a RAM tier (unbroken.RamTier, where it exists)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        unbroken.init_distributed("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    faults = Faults(args.faults, out, rank)

    if args.device != "cpu":
        torch.use_deterministic_algorithms(True)  # needs CUBLAS_WORKSPACE_CONFIG=:4096:8
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), Raise(faults),
                                torch.nn.Linear(32, C)).to(args.device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    loader = unbroken.data.ResumableLoader(Data(), batch_size=8, shuffle=True, seed=5)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}
    ram = dict(ram=unbroken.RamTier(keep_last=2, persist_every=4)) if args.ram else {}
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=None,
                                 async_save=args.async_save, **ram)
    ckpt.restore(state)
    log = open(out / f"losses-r{rank}.jsonl", "a")

    def train() -> int:
        while ckpt.progress.step < args.steps:
            for x, y, idx in loader:
                step = ckpt.progress.step + 1
                if faults.take(step, "kill"):
                    os.kill(os.getpid(), signal.SIGKILL)
                x, y = x.to(args.device), y.to(args.device)
                for kind in ("oom", "realoom", "oombw", "key"):
                    if faults.take(step, kind):
                        faults.armed = kind
                loss = F.cross_entropy(model(x), y)
                if args.spike_sample in idx.tolist():
                    loss = loss * 1e4
                if faults.take(step, "nan"):
                    loss = loss * float("nan")
                bad = torch.tensor([0 if torch.isfinite(loss) else 1])
                if world > 1:
                    dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # a global decision: every rank raises
                if bad.item():
                    raise FloatingPointError(f"non-finite loss at step {step}")
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                log.write(json.dumps({"step": step, "loss": loss.item(), "samples": idx.tolist()}) + "\n")
                log.flush()
                ckpt.step(state, loss=loss.detach())
                if ckpt.progress.step >= args.steps:
                    break
        return ckpt.progress.step

    extra = dict(rollback_if=lambda m: float(m["loss"]) > 1e3, skip_batches=args.skip_batches) \
        if args.rollback_if else {}
    done = ckpt.recover(train, state, on=(torch.OutOfMemoryError, FloatingPointError), retries=args.retries,
                        **extra)
    ckpt.close()
    if rank == 0:
        plain = model.module if world > 1 else model
        tensors = {f"model/{k}": v.detach().cpu().contiguous() for k, v in plain.state_dict().items()}
        for pid, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                tensors[f"optimizer/{pid}/{k}"] = torch.as_tensor(v).detach().cpu().contiguous().reshape(-1)
        save_file(tensors, str(out / "final.safetensors"))
    print(f"finished at step {done}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
