"""Mistake: an order-dependent accumulation (what atomics do on a GPU), different in every run."""
import os

import torch
import torch.nn.functional as F

import unbroken
import unbroken.data
from _common import RUN, TOTAL, BATCH, FEATURES, Points, make_model

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=0)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "data": loader}
ckpt.restore(state)
target = torch.arange(FEATURES * 8) % FEATURES


def scatter_sum(h: torch.Tensor) -> torch.Tensor:
    """Sum groups of columns in an order that changes from call to call (like index_add_ on CUDA)."""
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    perm = torch.randperm(h.shape[1], generator=torch.Generator().manual_seed(seed))
    return torch.zeros(h.shape[0], FEATURES).index_add_(1, target[perm], h[:, perm])


while ckpt.progress.step < TOTAL:
    for x, y in loader:
        h = (x.repeat(1, 8) * torch.linspace(0.1, 3.0, FEATURES * 8)).exp()
        loss = F.cross_entropy(model(scatter_sum(h) / 100), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
