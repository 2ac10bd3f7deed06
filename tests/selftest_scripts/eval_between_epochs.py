"""No mistake: an evaluation pass over a plain DataLoader after every epoch (8 steps). Creating its
iterator draws a base seed from the global torch RNG. A resume from the checkpoint of an epoch's last
step still runs that epoch's evaluation (the restored loader ends the epoch first), so the training is
bitwise identical, also with ``--dropout`` (the training step draws from the global RNG): a regression
test of the epoch boundary (before, such a resume skipped the evaluation and its draw)."""
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
loader = unbroken.data.ResumableLoader(Points(64), batch_size=BATCH, shuffle=True, seed=0)  # 8 steps per epoch
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
