"""No DataLoader: a counted loop over a tensor (``for i in ckpt.batches(range(0, n, BATCH))``), epochs of
6 steps with an evaluation and ``scheduler.step()`` at each epoch's end: exact. The selftest sees the epoch
ends through the run's ``progress.epoch`` (no DataLoader runs out here)."""
import torch
import torch.nn.functional as F

import unbroken
from _common import BATCH, FEATURES, RUN

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X = torch.randn(6 * BATCH, FEATURES, generator=g)
Y = (X.sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
ckpt = unbroken.Checkpointer(RUN, save_every=4)
state = {"model": model, "optimizer": opt, "scheduler": sched}
ckpt.restore(state)
for _epoch in ckpt.epochs(state, range(1000)):
    for i in ckpt.batches(range(0, len(X), BATCH)):
        loss = F.cross_entropy(model(X[i:i + BATCH]), Y[i:i + BATCH])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
    with torch.no_grad():
        model.eval()
        F.cross_entropy(model(X), Y)
        model.train()
    sched.step()
