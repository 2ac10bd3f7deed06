"""PyTorch Lightning, made resumable by one line: ``callbacks=[UnbrokenCallback(run)]``.

    pip install -e '.[lightning]'
    python examples/lightning_train.py --run-dir runs/lightning --steps 60

Kill it at any moment (``kill -9``, a preempted node, an OOM) and run the same command
again: it continues from the newest valid checkpoint — the module, optimizer, LR schedule,
``global_step``, the mid-epoch data position and the RNG streams Lightning does not save — and
ends with bitwise the same weights as a run that was never interrupted. SIGTERM finishes the
optimizer step under way, saves it and exits with status 75. The last line,
``final step ... sha256 ...``, fingerprints the result.

The train data comes from an ``unbroken.data.ResumableLoader`` (its position is a number, so a
resume starts mid-epoch without replaying batches); dropout, gradient accumulation and a
warmup + cosine schedule are there to show they resume exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys

import torch

import unbroken.data
from unbroken.integrations.lightning import UnbrokenCallback

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl


class Blobs(torch.utils.data.Dataset):
    """4 noisy clusters in 16 dimensions: a fixed synthetic classification set."""

    def __init__(self, n: int = 200) -> None:
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(4, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, 16, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[int(i)], self.y[int(i)]


class Classifier(pl.LightningModule):
    def __init__(self, total_steps: int) -> None:
        super().__init__()
        self.total_steps = total_steps
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(64, 4))

    def train_dataloader(self):
        return unbroken.data.ResumableLoader(Blobs(), batch_size=8, shuffle=True, seed=0)   # a resumable data position

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        warmup = 5

        def factor(step: int) -> float:  # linear warmup, then cosine to 0
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, self.total_steps - warmup))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def fingerprint(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/lightning")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    a = p.parse_args(argv)
    torch.manual_seed(0)  # the initial weights; a resume overwrites them with the checkpoint's
    model = Classifier(a.steps)
    callback = UnbrokenCallback(a.run_dir, save_every=a.save_every, keep_last=3)   # <- the one line
    trainer = pl.Trainer(max_steps=a.steps, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                         callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)  # Lightning's own .ckpt files: not needed by unbroken
    trainer.fit(model)                 # resumes from the newest valid checkpoint, or starts fresh
    print(f"resumed from step {callback.restored.step}" if callback.restored else "fresh start", flush=True)
    print(f"final step {trainer.global_step} sha256 {fingerprint(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
