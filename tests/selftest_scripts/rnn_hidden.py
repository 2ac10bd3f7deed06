"""Mistake: an RNN whose hidden state is carried from batch to batch (truncated backpropagation through
time, ``hidden = repackage_hidden(hidden)``) in a plain variable, not in the state: after a resume it
starts again from zeros. ``rnn_hidden.py --saved``: the fix the selftest prints, followed word for word (the
hidden state in an ``unbroken.Vars`` in the state before restore()): no mistake."""
import sys

import torch
import torch.nn.functional as F

import unbroken
import unbroken.data
from _common import BATCH, RUN, TOTAL, Points

HIDDEN = 16


def repackage_hidden(h: torch.Tensor) -> torch.Tensor:
    """Cut the graph to the previous batch (truncated BPTT), keep the values."""
    return h.detach()


torch.manual_seed(0)
model = torch.nn.ModuleDict({"rnn": torch.nn.GRU(4, HIDDEN, batch_first=True), "head": torch.nn.Linear(HIDDEN, 2)})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, seed=0, shuffle=False)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt, "data": loader}
hidden = torch.zeros(1, BATCH, HIDDEN)
if "--saved" not in sys.argv:
    ckpt.restore(state)
    while ckpt.progress.step < TOTAL:
        for x, y in loader:
            hidden = repackage_hidden(hidden)
            out, hidden = model["rnn"](x.view(-1, 4, 4), hidden)
            loss = F.cross_entropy(model["head"](out[:, -1]), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(state, loss=loss)
else:  # the fix the selftest prints, followed word for word: "loop = unbroken.Vars(hidden=<its first value>);
    # state['loop'] = loop before ckpt.restore(state), and use loop.hidden where the loop used hidden"
    loop = unbroken.Vars(hidden=torch.zeros(1, BATCH, HIDDEN))
    state["loop"] = loop
    ckpt.restore(state)
    while ckpt.progress.step < TOTAL:
        for x, y in loader:
            loop.hidden = repackage_hidden(loop.hidden)
            out, loop.hidden = model["rnn"](x.view(-1, 4, 4), loop.hidden)
            loss = F.cross_entropy(model["head"](out[:, -1]), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(state, loss=loss)
