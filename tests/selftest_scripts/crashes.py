"""Bad input: fails on its own at step 3, interrupted or not."""
import torch

import unbroken
from _common import RUN, make_model

model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt}
ckpt.restore(state)
while True:
    if ckpt.progress.step == 3:
        raise ValueError("the script's own bug: shapes do not match")
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.step(state)
