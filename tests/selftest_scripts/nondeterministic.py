"""Mistake: an order-dependent accumulation (what atomics do on a GPU), different in every run.

On a CPU every torch operation here is deterministic, so the GPU's behaviour is emulated: ``scatter_sum``
accumulates in a random order unless ``torch.are_deterministic_algorithms_enabled()``, as CUDA's
``index_add_`` takes its deterministic (sorted) path only then. ``--fixed``: the fix the selftest prints,
followed word for word (its first part, the one that applies to this script): identical."""
import os
import sys

import torch
import torch.nn.functional as F

import unbroken
import unbroken.data
from _common import RUN, TOTAL, BATCH, FEATURES, Points, make_model

if "--fixed" in sys.argv:  # the printed fix, word for word
    torch.use_deterministic_algorithms(True)

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=0)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "data": loader}
ckpt.restore(state)
target = torch.arange(FEATURES * 8) % FEATURES


def scatter_sum(h: torch.Tensor) -> torch.Tensor:
    """Sum groups of columns in an order that changes from call to call (like index_add_ on CUDA), unless
    deterministic algorithms are asked for (then in column order, like CUDA's deterministic path)."""
    if torch.are_deterministic_algorithms_enabled():
        perm = torch.arange(h.shape[1])
    else:
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
