"""The demo's training job: a small but complete training loop made resumable by unbroken.

It has everything that makes exact resumption hard: dropout (global torch RNG),
shuffled data and random augmentation through ``unbroken.data.ResumableLoader``
(optionally with worker processes), AdamW, a warmup + cosine LR schedule,
gradient accumulation over micro-batches, and a GradScaler. Run it, kill it at any
moment, run it again with the same arguments: it continues from the newest valid
checkpoint and ends with exactly the same parameters as a run that was never
killed.

    python -m unbroken.demo.train --run-dir runs/demo --out out/ --steps 150

Outputs in ``--out``: ``losses.jsonl`` (one line per completed step, appended by
every attempt), ``final.safetensors`` (parameters and optimizer tensors) and
``final.json`` (scheduler and scaler state), written when the run completes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import unbroken
import unbroken.data

N_SAMPLES, N_FEATURES, N_CLASSES = 4096, 64, 10
MICRO_BATCH, ACCUM = 32, 2
ASYNC: dict[str | None, bool | Literal["lazy"]] = {None: False, "copy": True, "lazy": "lazy"}  # --async-save


def make_dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic classification problem (a function of the seed only)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(N_CLASSES, N_FEATURES, generator=g) * 2
    y = torch.randint(0, N_CLASSES, (N_SAMPLES,), generator=g)
    x = centers[y] + torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    return x, y


class Augmented(Dataset):
    """Map-style dataset with random augmentation drawn from the sample's own generator."""

    def __init__(self, seed: int) -> None:
        self.x, self.y = make_dataset(seed)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: unbroken.data.SampleIndex) -> tuple[torch.Tensor, torch.Tensor]:
        g = i.generator()  # keyed by (seed, epoch, index): same with any num_workers, after any resume
        noise = torch.randn(N_FEATURES, generator=g) * 0.3
        sign = 1.0 if torch.rand((), generator=g).item() < 0.5 else -1.0
        return sign * self.x[i] + noise, self.y[i]


def make_model(hidden: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, N_CLASSES),
    )


def warmup_cosine(total: int, warmup: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # model init; the checkpoint restores everything after it
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loader = unbroken.data.ResumableLoader(Augmented(args.seed), batch_size=MICRO_BATCH, shuffle=True, seed=args.seed,
                                           num_workers=args.workers)
    model = make_model(args.hidden)
    if args.freeze_first:  # a frozen layer: its bytes never change (what incremental saves skip)
        model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, warmup=args.steps // 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=20)

    # --- unbroken: four lines ---------------------------------------------------
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=3, rng="rng" not in args.omit,
                                 preemption=unbroken.Preemption(requeue=args.requeue, grace_period=args.grace),
                                 async_save=ASYNC[args.async_save],
                                 incremental=args.incremental,
                                 ram=unbroken.RamTier(persist_every=args.ram) if args.ram else None)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "data": loader}
    for part in args.omit:  # negative controls for the tests: forget part of the state
        state.pop(part, None)
    info = ckpt.restore(state)
    where = f" ({'ram' if f'/unbroken-{os.getuid()}/' in info.path else 'disk'})" if info and args.ram else ""
    print(f"resumed from step {info.step}{where}" if info else "fresh start", flush=True)
    # -----------------------------------------------------------------------------

    batches = iter(loader)  # continues mid-epoch after a restore, nothing replayed

    def next_batch() -> Any:
        nonlocal batches
        for _ in range(2):
            try:
                return next(batches)
            except StopIteration:
                batches = iter(loader)  # next epoch
        raise RuntimeError("empty dataset")

    def crash(where: str, steps: list[int]) -> None:
        """Test hook: raise once (per output folder) inside the given steps."""
        step = ckpt.progress.step + 1
        marker = out / f"crashed-{where}-{step}"
        if step in steps and not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected failure {where} optimizer.step() in step {step}")

    # guard: if a step raises (OOM, bad batch, ...), write an exact emergency checkpoint first
    with open(out / "losses.jsonl", "a") as log, ckpt.guard(state):
        while ckpt.progress.step < args.steps:
            model.train()
            total = 0.0
            for _ in range(ACCUM):
                x, y = next_batch()
                loss = F.cross_entropy(model(x), y) / ACCUM
                scaler.scale(loss).backward()
                total += loss.item()
                ckpt.progress.micro_step += 1
            ckpt.progress.epoch, ckpt.progress.samples = loader.epoch, loader.samples_seen
            crash("before", args.crash_before_opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            log.write(json.dumps({"step": ckpt.progress.step + 1, "loss": total}) + "\n")
            log.flush()
            crash("after", args.crash_after_opt)
            print(f"step {ckpt.progress.step + 1}", flush=True)
            if ckpt.progress.step + 1 == args.steps:
                hold_for_the_harness()
            ckpt.step(state, loss=total)  # saves every --save-every steps; saves and exits on SIGTERM

    ckpt.close()  # release the run (and wait for uploads of a tiered run)
    write_final(out, model, opt, sched, scaler)
    print("done", flush=True)
    return 0


def hold_for_the_harness() -> None:
    """Test hook (:func:`unbroken.demo.run_attempt`): before the last step's boundary, wait until the harness has
    sent the signal it planned (the file named by ``UNBROKEN_DEMO_HOLD`` exists; at most a minute)."""
    from . import HOLD_ENV, HOLD_TIMEOUT_S

    sent = os.environ.get(HOLD_ENV)
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while sent and not os.path.exists(sent) and time.monotonic() < deadline:
        time.sleep(0.01)


def write_final(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                scaler: torch.amp.GradScaler) -> None:
    """Final state in formats independent of unbroken, for the bitwise comparison."""
    from safetensors.torch import save_file

    tensors = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            tensors[f"optimizer/{pid}/{k}"] = v.contiguous()
    save_file(tensors, str(out / "final.safetensors"))
    other = {"scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
             "param_groups": opt.state_dict()["param_groups"]}
    (out / "final.json").write_text(json.dumps(other, sort_keys=True, default=repr))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--requeue", action="store_true", help="requeue the SLURM job after a preemption save")
    p.add_argument("--grace", type=float, default=None, help="seconds between the signal and a hard kill")
    p.add_argument("--crash-before-opt", type=int, action="append", default=[], metavar="STEP",
                   help="raise an exception in STEP before optimizer.step() (once)")
    p.add_argument("--crash-after-opt", type=int, action="append", default=[], metavar="STEP",
                   help="raise an exception in STEP after optimizer.step() and its bookkeeping (once)")
    p.add_argument("--async-save", nargs="?", const="copy", choices=["copy", "lazy"],
                   help="write checkpoints in the background; 'lazy' also copies the optimizer's tensors "
                        "in the background, until the next optimizer step")
    p.add_argument("--incremental", action="store_true", help="incremental checkpoints (content-addressed chunks)")
    p.add_argument("--ram", type=int, default=0, metavar="N",
                   help="save to a RAM tier (unbroken.RamTier, its root from UNBROKEN_RAM_ROOT), persisting every N")
    p.add_argument("--freeze-first", action="store_true", help="freeze the first layer (not trained)")
    p.add_argument("--omit", action="append", default=[], choices=["rng", "scheduler", "scaler", "data"],
                   help="leave this out of the checkpoint (to show that the comparison catches it)")
    return train(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
