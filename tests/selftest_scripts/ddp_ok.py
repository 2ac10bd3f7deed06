"""No mistake, under torchrun: DDP over gloo on CPU, a ResumableLoader (rank r takes the r-th slice of each
global batch). ``ddp_ok.py --rank1-draws-after-restore``: the mistake of rng_after_restore.py on rank 1 only
(a module created after restore() draws from its global RNG: its dropout then differs after a resume)."""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unbroken
import unbroken.data
from _common import BATCH, TOTAL, Points, make_model

unbroken.init_distributed("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(make_model())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = unbroken.data.ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=0)
ckpt = unbroken.Checkpointer("runs/selftest-ddp", save_every=4)  # the selftest overrides the location
state = {"model": model, "optimizer": opt, "data": loader}
ckpt.restore(state)
if "--rank1-draws-after-restore" in sys.argv and rank == 1:
    probe_head = torch.nn.Linear(2, 2)  # the mistake: on rank 1 only, a draw from the global RNG after restore()
while ckpt.progress.step < TOTAL:
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
