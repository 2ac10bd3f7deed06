"""Mistake: batches drawn by the loop from the global RNG (nanoGPT's ``get_batch``), the next one fetched
ahead inside the step and not saved: a resume draws the batch after it, and every later draw shifts.
``prefetched_batch.py --fixed``: the documented recipe (docs/your-loop.md): the fetched batch in the state."""
import sys

import torch
import torch.nn.functional as F

import unbroken
from _common import RUN, TOTAL, BATCH, Points, make_model

data = Points()
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def get_batch():
    ix = torch.randint(len(data), (BATCH,))
    return data.x[ix], data.y[ix]


ckpt = unbroken.Checkpointer(RUN, save_every=5)
fetched = unbroken.Vars(X=None, Y=None)
state = {"model": model, "optimizer": opt, **({"fetched": fetched} if "--fixed" in sys.argv else {})}
ckpt.restore(state)
iter_num = ckpt.progress.step  # set from the progress after restore(): right in both runs, never to blame
X, Y = (fetched.X, fetched.Y) if fetched.X is not None else get_batch()
while ckpt.progress.step < TOTAL:
    loss = F.cross_entropy(model(X), Y)
    X, Y = get_batch()  # the next batch, fetched ahead
    loss.backward()
    opt.step()
    opt.zero_grad()
    fetched.X, fetched.Y = X, Y
    ckpt.step(state, loss=loss)
    iter_num += 1
