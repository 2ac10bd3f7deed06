"""A tiny Lightning training job for tests/test_integration_lightning.py, run as a subprocess.

Dropout, shuffled data (an ``unbroken.data.ResumableLoader``, or with ``--data plain`` a
``DataLoader(shuffle=True)``, or with ``--data torch-order`` a ``ResumableLoader(order="dataloader")``),
AdamW with a warmup + cosine schedule stepped per optimizer
step, ``accumulate_grad_batches=2``, an odd number of batches per epoch (the last batch of
an epoch steps alone). Every micro-batch prints ``LOSS epoch batch_idx global_step repr(loss)``;
at the end ``--out`` gets ``final.pt`` (weights, optimizer state) and ``final.json``
(global_step, current_epoch).

``--mode unbroken``: ``UnbrokenCallback(run, save_every=N)``, resumed by running again; Lightning keeps
its default ``ModelCheckpoint`` (a ``.ckpt`` in ``--out``/checkpoints at each epoch end) unless
``--no-lightning-checkpointing`` (``enable_checkpointing=False``).
``--flavour``: the Trainer, the LightningModule and the callbacks from ``pytorch_lightning`` (the
default) or from ``lightning.pytorch``.
``--mode lightning``: Lightning's own checkpointing: ``ModelCheckpoint(every_n_train_steps=N,
save_last=True)`` (+ ``OnExceptionCheckpoint`` with ``--on-exception``) and ``fit(ckpt_path="last")``.
``--mode plain``: Lightning alone, no checkpointing at all (an uninterrupted run to compare with).
``--crash-at S``: raise in micro-batch ``--crash-micro`` (0 or 1; the second runs inside
``optimizer.step(closure)``) of optimizer step S+1, once (a marker file).
``--lightning-kill-in-save N``: SIGKILL this process half-way through writing Lightning's Nth checkpoint file.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
from pathlib import Path
from types import ModuleType

# both Lightning packages imported first thing (unbroken's integration imports every one installed anyway): the
# suite's fork server then starts this script with them imported (tests/zygote.py); either may be missing
# (test_with_one_lightning_package_installed hides one)
try:
    import lightning.pytorch as lightning_pytorch
except ImportError:
    lightning_pytorch = None
try:
    import pytorch_lightning
except ImportError:
    pytorch_lightning = None
import torch
from torch.utils.data import DataLoader, Dataset

import unbroken.data

N, DIM, CLASSES, BATCH, ACC = 100, 16, 4, 8, 2  # 13 batches per epoch: 7 optimizer steps


class Data(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[int(i)], self.y[int(i)]


def lightning(flavour: str) -> ModuleType:
    """The Lightning package of the Trainer, the LightningModule and the callbacks."""
    return lightning_pytorch if flavour == "lightning" else pytorch_lightning


class Training:
    """The LightningModule's methods, whichever Lightning it derives from (:func:`model_class`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(64, CLASSES))

    def train_dataloader(self):
        if self.args.data == "plain":
            return DataLoader(Data(), batch_size=BATCH, shuffle=True)
        order = "dataloader" if self.args.data == "torch-order" else "unbroken"
        return unbroken.data.ResumableLoader(Data(), batch_size=BATCH, shuffle=True, seed=7, order=order)

    def training_step(self, batch, batch_idx):
        a = self.args
        if a.crash_at is not None and self.trainer.global_step == a.crash_at and batch_idx % ACC == a.crash_micro:
            marker = Path(a.out) / f"crashed-{a.crash_at}"
            if not marker.exists():
                marker.touch()
                raise RuntimeError(f"injected failure at step {a.crash_at}")
        if a.sigterm_at is not None and self.trainer.global_step == a.sigterm_at and batch_idx % ACC == 0:
            marker = Path(a.out) / f"sigterm-{a.sigterm_at}"
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of an accumulation window
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        print(f"LOSS {self.current_epoch} {batch_idx} {self.trainer.global_step} {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        warmup, total = 5, self.args.steps

        def lr(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@functools.cache
def model_class(pl: ModuleType) -> type:
    """The test's ``LightningModule`` for the Lightning package ``pl``."""
    return type("Model", (Training, pl.LightningModule), {"__module__": __name__})


def kill_in_lightning_save(nth: int, pl: ModuleType) -> None:
    """Make the nth checkpoint file Lightning writes a torn one: half the bytes, then SIGKILL."""
    if pl.__name__ == "lightning.pytorch":
        import lightning.fabric.plugins.io.torch_io as torch_io
    else:
        import lightning_fabric.plugins.io.torch_io as torch_io

    real = torch_io._atomic_save
    count = [0]

    def torn(checkpoint, filepath):
        count[0] += 1
        if count[0] < nth:
            return real(checkpoint, filepath)
        import io

        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        data = buf.getvalue()
        with open(filepath, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        print("KILLED IN SAVE", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    torch_io._atomic_save = torn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["unbroken", "lightning", "plain"], default="unbroken")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=["resumable", "plain", "torch-order"], default="resumable")
    p.add_argument("--crash-at", type=int)
    p.add_argument("--crash-micro", type=int, default=1, help="which micro-batch of the step raises")
    p.add_argument("--sigterm-at", type=int, help="SIGTERM to itself in the first micro-batch of step S+1, once")
    p.add_argument("--on-exception", action="store_true")
    p.add_argument("--lightning-kill-in-save", type=int)
    p.add_argument("--flavour", choices=["pytorch_lightning", "lightning"], default="pytorch_lightning")
    p.add_argument("--no-lightning-checkpointing", action="store_true", help="enable_checkpointing=False")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl = lightning(args.flavour)
    torch.use_deterministic_algorithms(True)
    pl.seed_everything(args.seed, verbose=False)
    model = model_class(pl)(args)
    kw = dict(accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=ACC,
              enable_progress_bar=False, logger=False, enable_model_summary=False, num_sanity_val_steps=0,
              default_root_dir=args.out)
    if args.mode == "unbroken":
        from unbroken.integrations.lightning import UnbrokenCallback

        trainer = pl.Trainer(callbacks=[UnbrokenCallback(args.run_dir, save_every=args.save_every)],
                             enable_checkpointing=not args.no_lightning_checkpointing, **kw)
        trainer.fit(model)
    elif args.mode == "plain":  # Lightning alone, no checkpointing at all
        trainer = pl.Trainer(enable_checkpointing=False, **kw)
        trainer.fit(model)
    else:
        if args.lightning_kill_in_save:
            kill_in_lightning_save(args.lightning_kill_in_save, pl)
        cbs = [pl.callbacks.ModelCheckpoint(dirpath=args.run_dir, every_n_train_steps=args.save_every,
                                            save_last=True, save_top_k=1)]
        if args.on_exception:
            cbs.append(pl.callbacks.OnExceptionCheckpoint(args.run_dir))
        trainer = pl.Trainer(callbacks=cbs, **kw)
        trainer.fit(model, ckpt_path="last")
    torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": trainer.optimizers[0].state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"]},
               Path(args.out) / "final.pt")
    (Path(args.out) / "final.json").write_text(json.dumps(
        {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch}))
    print("FINISHED", trainer.global_step, flush=True)


if __name__ == "__main__":
    sys.exit(main())
