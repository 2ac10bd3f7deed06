"""bench_goodput.py's training loop with unbroken: disk-only, RAM tier, in-process recovery.

* ``disk``: ``Checkpointer(run, save_every=N)``, state = model, AdamW and a
  ``unbroken.data.ResumableLoader`` (the data position is a count of global samples).
* ``ram``: ``Checkpointer(run, save_every=1, ram=unbroken.RamTier(keep_last=2, persist_every=N))``.
* ``auto``: ``Checkpointer(run, save_every="auto")`` (the interval from what saves block and the run's failures).
* ``ram-auto``: the RAM tier with ``save_every="auto"``: the RAM saves' interval chosen the same way, every
  ``N``-th RAM checkpoint persisted.

``--mtbf-prior-hours H`` gives the ``auto`` configurations ``AutoInterval(mtbf_hours=H)`` (the failure rate
assumed until the run has had a failure; the library's default otherwise).
* ``inproc``: ``disk`` run inside ``ckpt.recover(train, state, on=(InjectedFault,))``, which
  restores the newest checkpoint in place after the exception and calls ``train`` again.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

import unbroken
from unbroken.data import ResumableLoader


def train_step(model: Any, opt: Any, batch: torch.Tensor) -> None:
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _every(every: Any) -> dict[str, Any]:
    """``save_every=`` for a number or ``"auto"``, ``trigger=`` for an :class:`AutoInterval` with a prior."""
    return {"save_every": every} if isinstance(every, (int, str)) else {"trigger": every}


class Loop:
    def __init__(self, model: Any, opt: Any, ds: Any, a: Any, events: Any, faults: Any, fault_type: type) -> None:
        self.model, self.opt, self.a = model, opt, a
        self.events, self.faults, self.fault_type = events, faults, fault_type
        self.loader = ResumableLoader(ds, batch_size=a.batch, shuffle=True, seed=0, num_workers=0)
        auto: Any = "auto"
        if a.mtbf_prior_hours is not None:
            from unbroken.policies import AutoInterval

            auto = AutoInterval(mtbf_hours=a.mtbf_prior_hours)
        if a.config in ("ram", "ram-auto"):
            every: Any = auto if a.config == "ram-auto" else 1
            ram = unbroken.RamTier(keep_last=2, persist_every=a.save_every)
            self.ckpt = unbroken.Checkpointer(a.run_dir, **_every(every), keep_last=2, ram=ram)
        else:
            self.ckpt = unbroken.Checkpointer(a.run_dir, **_every(auto if a.config == "auto" else a.save_every),
                                              keep_last=2)
        self.state = {"model": model, "optimizer": opt, "data": self.loader}

    def step_no(self) -> int:
        return self.ckpt.progress.step

    def run(self) -> None:
        self.events("ready")
        self.ckpt.restore(self.state)
        if self.a.config == "inproc":
            self.ckpt.recover(self.train, self.state, on=(self.fault_type,), retries=10_000)
        else:
            self.train()
        self.ckpt.close()

    def train(self) -> None:
        self.events("restored", step=self.ckpt.progress.step)
        batches = iter(self.loader)
        while self.ckpt.progress.step < self.a.steps:
            t0 = time.time()
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(self.loader)
                batch = next(batches)
            step = self.ckpt.progress.step + 1
            self.faults.check(step, self.events, self.a.steps)
            train_step(self.model, self.opt, batch)
            self.events.step(step, t0)
            self.ckpt.step(self.state)
