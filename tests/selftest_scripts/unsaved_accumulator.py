"""Mistake: a running mean of the loss (used to normalise it) kept outside the state."""
import torch
import torch.nn.functional as F

import unbroken
import unbroken.data
from _common import RUN, TOTAL, BATCH, Points, make_model

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, seed=0)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "data": loader}
ckpt.restore(state)
running = 1.0  # the mistake: an accumulator outside the state
while ckpt.progress.step < TOTAL:
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        (loss / running).backward()
        running = 0.9 * running + 0.1 * loss.item()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
