"""No mistake: an evaluation pass over a plain DataLoader after every epoch (8 steps). Creating its
iterator draws a base seed from the global torch RNG; the training step draws nothing from it (no
dropout), so a resume at an epoch boundary, which skips that evaluation, trains bitwise identically.
``eval_between_epochs.py --dropout``: the mistake: the training step draws from the global RNG
(dropout), so the evaluation skipped after a resume at an epoch boundary changes its masks."""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import unbroken
import unbroken.data
from _common import BATCH, RUN, TOTAL, Points, make_model


def evaluate(model: torch.nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(loader.dataset)


model = make_model(dropout="--dropout" in sys.argv)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(64), batch_size=BATCH, seed=0)  # 8 steps per epoch
eval_loader = DataLoader(Points(32, seed=1), batch_size=16)  # a plain DataLoader: its iterator draws a base seed
ckpt = unbroken.Checkpointer(RUN, save_every=4)
state = {"model": model, "optimizer": opt, "data": loader}
ckpt.restore(state)
while ckpt.progress.step < TOTAL:
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
    print(f"epoch {loader.epoch}: accuracy {evaluate(model, eval_loader):.3f}", flush=True)
