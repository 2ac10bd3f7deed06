"""Bad input: hangs after two steps, with a child process of its own (pid written to argv[2])."""
import subprocess
import sys
import time
from pathlib import Path

import torch

import unbroken
from _common import RUN, make_model

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path(sys.argv[2]).write_text(str(child.pid))
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = unbroken.Checkpointer(RUN, save_every=5)
state = {"model": model, "optimizer": opt}
ckpt.restore(state)
for _ in range(2):
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.step(state)
time.sleep(600)  # waits for something that never comes
