"""A resumable evaluation job: kill it at any point, run it again, get the same numbers.

Evaluation over a large dataset is a loop too: its state is the data position and the
metrics accumulated so far. Both go into the checkpoint, so a preempted evaluation
continues where it stopped instead of starting over (Lingua resumes eval jobs the same
way), and the final metrics are bitwise what an uninterrupted pass gives, because the
batches are accumulated in the same order.

    python examples/resumable_eval.py --run-dir runs/eval --out metrics.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils.data import Dataset

import unbroken
import unbroken.data


class Points(Dataset):
    """A fixed synthetic regression set (a function of the index only)."""

    def __len__(self) -> int:
        return 20_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(i))
        x = torch.randn(8, generator=g)
        return x, x.sum(dim=0, keepdim=True) + 0.1 * torch.randn(1, generator=g)


class Accumulator:
    """Running sums of the evaluation metrics: Stateful, so they are checkpointed too."""

    def __init__(self) -> None:
        self.loss_sum, self.abs_err_sum, self.count = 0.0, 0.0, 0

    def add(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        err = (pred - target).double()
        self.loss_sum += err.pow(2).sum().item()
        self.abs_err_sum += err.abs().sum().item()
        self.count += target.shape[0]

    def result(self) -> dict[str, float]:
        return {"mse": self.loss_sum / self.count, "mae": self.abs_err_sum / self.count, "count": self.count}

    def state_dict(self) -> dict[str, float]:
        return {"loss_sum": self.loss_sum, "abs_err_sum": self.abs_err_sum, "count": self.count}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.loss_sum, self.abs_err_sum, self.count = d["loss_sum"], d["abs_err_sum"], int(d["count"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--save-every", type=int, default=20, help="batches between checkpoints")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)  # stands in for a trained model loaded from its checkpoint
    model.eval()
    loader = unbroken.data.ResumableLoader(Points(), batch_size=64, shuffle=False)
    metrics = Accumulator()
    state = {"data": loader, "metrics": metrics}
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=1)
    info = ckpt.restore(state)
    print(f"resumed at batch {info.step}" if info else "fresh start", flush=True)
    if loader.epoch == 0:  # one pass: epoch 1 means this evaluation is already complete
        with torch.no_grad():
            for x, y in loader:
                metrics.add(model(x), y)
                ckpt.step(state)
                print(f"step {ckpt.progress.step}", flush=True)
    with open(args.out, "w") as f:
        json.dump(metrics.result(), f)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
