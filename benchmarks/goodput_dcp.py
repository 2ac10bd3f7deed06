"""bench_goodput.py's careful do-it-yourself loop: torch.distributed.checkpoint by hand.

What a good engineer writes without a checkpointing library:

* ``dcp.save`` every ``--save-every`` steps (``dcp.async_save`` for ``dcp-async``, committed
  when its future is done, waited for before the next save) of the model and AdamW state from
  ``get_state_dict``, the step counter, and every rank's RNGs (torch, python, numpy) under a
  key of its own. Each save goes to ``step-N.tmp``; rank 0 renames it to ``step-N`` once
  ``dcp.save`` returned (DCP's finish step ends there, after every rank wrote its shard and
  rank 0 the ``.metadata``), fsyncs the run folder and keeps the last two.
* Restore: ``dcp.load`` of the newest ``step-N`` that has its ``.metadata``, then
  ``set_state_dict``; the data (a ``DataLoader`` with a ``DistributedSampler(shuffle=True,
  seed=0)``) is brought back to the saved step by skipping: ``set_epoch`` and ``next()`` on
  the iterator ``step mod len(loader)`` times. RNGs are restored after the iterator is made
  (creating it draws from the global torch RNG).
* ``init_process_group("gloo")`` under ``torchrun --max-restarts``: with
  ``TORCH_GLOO_LAZY_INIT=1`` while it runs, as a restart needs (the agent's store keeps the
  previous round's keys; connecting at the first collective is what lets the group come back).
  ``dcp-async`` saves on a second gloo group (``new_group``, so the save's collectives in its
  thread do not interleave with DDP's on the default group), made lazily for the same reason:
  made eagerly, its constructor connected to the addresses the previous round's ranks had left
  in the agent's store, and after a restart both ranks waited in ``ProcessGroupGloo``'s
  ``connectFullMesh`` (``Pair::waitUntilConnected``, seen with gdb) for the group's 30-minute
  timeout: the hang this configuration had, not DCP's background save.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler

from goodput_unbroken import train_step

KEEP = 2


@contextlib.contextmanager
def lazy_gloo() -> Iterator[None]:
    """Gloo groups made inside connect at their first collective, not in their constructor."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        del os.environ["TORCH_GLOO_LAZY_INIT"]


def init() -> None:
    with lazy_gloo():
        dist.init_process_group("gloo")


def complete(run: Path) -> list[Path]:
    found = [p for p in run.glob("step-*") if not p.name.endswith(".tmp") and (p / ".metadata").exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


class Loop:
    def __init__(self, model: Any, opt: Any, ds: Any, a: Any, events: Any, faults: Any, async_save: bool) -> None:
        self.model, self.opt, self.a = model, opt, a
        self.events, self.faults, self.async_save = events, faults, async_save
        self.rank = dist.get_rank()
        self.sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
        self.loader = DataLoader(ds, batch_size=a.batch, sampler=self.sampler, num_workers=0, drop_last=True)
        self.run_dir = Path(a.run_dir)
        self.step = 0
        self.pending: tuple[Any, Path] | None = None
        self.group = None
        if async_save:  # lazily too: see the module docstring (an eager one hung after a restart)
            with lazy_gloo():
                self.group = dist.new_group(backend="gloo")

    def step_no(self) -> int:
        return self.step

    def state(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.opt)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        return {"model": msd, "optim": osd, "progress": {"step": self.step}, f"rng-r{self.rank}": rng}

    def run(self) -> None:
        self.events("ready")
        rng = self.restore()
        self.events("restored", step=self.step)
        epoch, skip = divmod(self.step, len(self.loader))
        self.sampler.set_epoch(epoch)
        batches = iter(self.loader)
        for _ in range(skip):  # back to the saved position: the batches already trained on, loaded again
            next(batches)
        if rng is not None:  # after iter(): making the iterator draws a seed from the global RNG
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
        while self.step < self.a.steps:
            t0 = time.time()
            try:
                batch = next(batches)
            except StopIteration:
                epoch += 1
                self.sampler.set_epoch(epoch)
                batches = iter(self.loader)
                batch = next(batches)
            self.faults.check(self.step + 1, self.events, self.a.steps)
            train_step(self.model, self.opt, batch)
            self.step += 1
            self.events.step(self.step, t0)
            if self.step % self.a.save_every == 0:
                self.save()
        self.finish()

    def restore(self) -> dict[str, Any] | None:
        found = complete(self.run_dir)
        if not found:
            return None
        state = self.state()
        dcp.load(state, checkpoint_id=found[-1])
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = int(state["progress"]["step"])
        return state[f"rng-r{self.rank}"]

    def save(self) -> None:
        self.finish()
        tmp = self.run_dir / f"step-{self.step:09d}.tmp"
        if self.async_save:
            self.pending = (dcp.async_save(self.state(), checkpoint_id=tmp, process_group=self.group), tmp)
        else:
            dcp.save(self.state(), checkpoint_id=tmp)
            self.commit(tmp)

    def finish(self) -> None:
        if self.pending is not None:
            future, tmp = self.pending
            self.pending = None
            future.result()
            self.commit(tmp)

    def commit(self, tmp: Path) -> None:
        if self.rank != 0:
            return
        tmp.rename(tmp.with_suffix(""))
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in complete(self.run_dir)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
