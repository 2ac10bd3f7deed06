"""No mistake: an evaluation pass over a plain DataLoader every 8 steps, inside the batch loop after
``ckpt.step()`` (like the HF Trainer's ``eval_steps``), with a save every 4 steps. The checkpoint of
step 8 is taken before that step's evaluation, so a resume from it does not redo the evaluation:
creating its iterator draws a base seed from the global torch RNG, which the training step does not
draw from (no dropout), so the training is bitwise identical. An epoch (64 steps) is longer than the test.
``eval_every_k_steps.py --dropout``: the mistake: the training step draws from the global RNG
(dropout), so the evaluation a resume skipped changes its masks."""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import unbroken
import unbroken.data
from _common import BATCH, RUN, TOTAL, Points, make_model

EVAL_EVERY = 8


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
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=0)  # 64 steps per epoch
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
        if ckpt.progress.step % EVAL_EVERY == 0:
            print(f"step {ckpt.progress.step}: accuracy {evaluate(model, eval_loader):.3f}", flush=True)
