"""Mistake: a torch.Generator for input noise that is not in the state: it restarts from its seed.
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
noise = torch.Generator().manual_seed(1)  # the mistake: not in the state
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "data": loader}
if "--fixed" in sys.argv:  # the printed fix, word for word
    state["gen"] = noise
ckpt.restore(state)
while ckpt.progress.step < TOTAL:
    for x, y in loader:
        x = x + 0.1 * torch.randn(x.shape, generator=noise)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
