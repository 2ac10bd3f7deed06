# nanoGPT's train.py (https://github.com/karpathy/nanoGPT, MIT license), the shape of its training loop
# kept line for line on one CPU process: batches sampled from the global torch RNG (torch.randint offsets
# into a token array), the NEXT batch fetched inside the step while the current one is still being
# computed, gradient accumulation, the cosine LR schedule of iter_num, gradient clipping, and an
# evaluation every eval_interval iterations that draws batches of its own. Synthetic tokens (its
# train.bin/val.bin are uint16 token arrays too) and a tiny model stand in for the data and the GPT; DDP,
# AMP, wandb, torch.compile and nanoGPT's own checkpointing are left out. The lines unbroken needs are
# marked `# +unbroken` (added) and `# ~unbroken` (changed). Nothing else differs.
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

import unbroken  # +unbroken

# -----------------------------------------------------------------------------
# default config values
eval_interval = 10
log_interval = 1
eval_iters = 3
gradient_accumulation_steps = 2
batch_size = 4
block_size = 16
vocab_size = 64
n_embd = 32
dropout = 0.1
learning_rate = 1e-3
max_iters = int(os.environ.get("GPT_MAX_ITERS", "30"))
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 5
lr_decay_iters = 30
min_lr = 1e-4
# -----------------------------------------------------------------------------

torch.manual_seed(1337)

# poor man's data loader
rng = np.random.default_rng(0)
train_data = rng.integers(0, vocab_size, 4096).astype(np.uint16)
val_data = rng.integers(0, vocab_size, 1024).astype(np.uint16)


def get_batch(split):
    data = train_data if split == 'train' else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i+block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i+1:i+1+block_size]).astype(np.int64)) for i in ix])
    return x, y


class GPT(nn.Module):
    """A stand-in for nanoGPT's model: token and position embeddings, one MLP block, the LM head."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = x + self.drop(self.proj(F.gelu(self.fc(x))))
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay)


# helps estimate an arbitrarily accurate loss over either split using many batches
@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


# learning rate decay scheduler (cosine with warmup)
def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


ckpt = unbroken.Checkpointer("runs/gpt", save_every=4)  # +unbroken
fetched = unbroken.Vars(X=None, Y=None)  # +unbroken: the batch fetched ahead, saved with the step that fetched it
state = {"model": model, "optimizer": optimizer, "fetched": fetched}  # +unbroken
ckpt.restore(state)  # +unbroken
iter_num = ckpt.progress.step  # ~unbroken: was iter_num = 0

# training loop
X, Y = (fetched.X, fetched.Y) if fetched.X is not None else get_batch('train')  # ~unbroken: was get_batch('train')
t0 = time.time()
while True:

    # determine and set the learning rate for this iteration
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    # evaluate the loss on train/val sets
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")

    # forward backward update, with optional gradient accumulation to simulate larger batch size
    for micro_step in range(gradient_accumulation_steps):
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
        # immediately async prefetch next batch while model is doing the forward pass on the GPU
        X, Y = get_batch('train')
        loss.backward()
    # clip the gradient
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)

    # timing and logging
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms")
    fetched.X, fetched.Y = X, Y  # +unbroken
    ckpt.step(state, loss=loss.detach() * gradient_accumulation_steps)  # +unbroken
    iter_num += 1

    # termination conditions
    if iter_num > max_iters:
        break
ckpt.close()  # +unbroken
