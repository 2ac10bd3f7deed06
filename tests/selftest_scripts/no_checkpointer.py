"""Bad input: trains without unbroken at all."""
import torch

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print("done")
