"""Mistake: a plain DataLoader(shuffle=True) outside the state: after a resume its epoch restarts.
``--fixed``: the fix the selftest prints, followed word for word (identical)."""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import unbroken
import unbroken.data
from _common import RUN, TOTAL, BATCH, Points, make_model

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Points(), batch_size=BATCH, shuffle=True)  # the mistake: order from the global RNG, not saved
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt}
if "--fixed" in sys.argv:  # the printed fix, word for word
    loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, shuffle=True)
    state["data"] = loader
ckpt.restore(state)
while ckpt.progress.step < TOTAL:
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
