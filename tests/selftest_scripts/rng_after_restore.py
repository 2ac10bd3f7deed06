"""Mistake: a module created after restore() draws from the global torch RNG (dropout then differs).
``--fixed``: the fix the selftest prints, followed word for word (identical)."""
import sys

import torch
import torch.nn.functional as F

import unbroken
import unbroken.data
from _common import RUN, TOTAL, BATCH, Points, make_model

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=0)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "data": loader}
if "--fixed" in sys.argv:  # the printed fix: that code moved before ckpt.restore(state)
    probe_head = torch.nn.Linear(2, 2)
ckpt.restore(state)
if "--fixed" not in sys.argv:
    probe_head = torch.nn.Linear(2, 2)  # the mistake: its initialisation draws from the global RNG after restore()
while ckpt.progress.step < TOTAL:
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
