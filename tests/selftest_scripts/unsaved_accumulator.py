"""Mistake: a running mean of the loss (used to normalise it) kept outside the state.
``unsaved_accumulator.py --attribute``: the same running mean kept in an object's attribute, where the
selftest does not look for carried values: it must say that it cannot tell, with the differing values.
``--fixed``: the fix the selftest prints, followed word for word (identical)."""
import sys

import torch
import torch.nn.functional as F

import unbroken
import unbroken.data
from _common import RUN, TOTAL, BATCH, Points, make_model


class Stats:
    def __init__(self) -> None:
        self.running = 1.0


model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=0)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "data": loader}
if "--fixed" in sys.argv:  # the printed fix, word for word: loop = unbroken.Vars(running=<its first value>)
    loop = unbroken.Vars(running=1.0)
    state["loop"] = loop
ckpt.restore(state)
running = 1.0  # the mistake: an accumulator outside the state
stats = Stats()
while ckpt.progress.step < TOTAL:
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        if "--attribute" in sys.argv:
            (loss / stats.running).backward()
            stats.running = 0.9 * stats.running + 0.1 * loss.item()
        elif "--fixed" in sys.argv:  # ... and use loop.running where the loop used running
            (loss / loop.running).backward()
            loop.running = 0.9 * loop.running + 0.1 * loss.item()
        else:
            (loss / running).backward()
            running = 0.9 * running + 0.1 * loss.item()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
