"""Mistake: the data iterator is created before restore(): it serves the order from where it started.
``--fixed``: the fix the selftest prints, followed word for word (identical)."""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import unbroken
from _common import RUN, TOTAL, BATCH, N, Points, make_model


class Batches:
    """A resumable batch sampler written by hand (its position is in the state)."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()
        batches = [order[i:i + BATCH] for i in range(0, N, BATCH)]
        return (self._advance(b) for b in batches[self.pos:])  # reads the position when the iterator is created

    def _advance(self, b):
        self.pos += 1
        return b

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = Batches()
loader = DataLoader(Points(), batch_sampler=sampler)
if "--fixed" in sys.argv:  # the printed fix: "... give it its own: DataLoader(..., generator=torch.Generator())"
    loader = DataLoader(Points(), batch_sampler=sampler, generator=torch.Generator())
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "sampler": sampler}
if "--fixed" not in sys.argv:
    batches = iter(loader)  # the mistake: before restore()
ckpt.restore(state)
if "--fixed" in sys.argv:  # the printed fix: the iterator created after ckpt.restore(state)
    batches = iter(loader)
while ckpt.progress.step < TOTAL:
    x, y = next(batches)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ckpt.step(state, loss=loss)
