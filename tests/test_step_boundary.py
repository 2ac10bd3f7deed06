"""The step boundary is one owned transition: an exception at *every* point of a step leaves
either the previous committed checkpoint or an emergency checkpoint of one instant, and the
resumed run is bitwise the uninterrupted one (DataLoader workers 0 and 2).

Each case trains in this process under ``ckpt.guard(state)``, raises once at the chosen
point of step ``FAIL_AT``, then a fresh set of objects (a "new process": every global RNG is
restored by the Checkpointer) resumes from the run folder and trains to the end.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import unbroken
import unbroken.data
from unbroken.checkpoint import persist
from unbroken.faults import EXIT_PREEMPTED

STEPS, SAVE_EVERY, FAIL_AT = 9, 3, 5


class Data(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8, generator=i.generator()), self.y[i]


class Boom(RuntimeError):
    pass


class HalfStepAdamW(torch.optim.AdamW):
    """Raises after updating the parameters, before the step's post hooks: a torn step."""

    fail = False

    def step(self, closure=None):  # type: ignore[override]
        out = super().step(closure)
        if HalfStepAdamW.fail:
            HalfStepAdamW.fail = False
            raise Boom("optimizer failed half-way")
        return out


def build(workers: int):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    opt = HalfStepAdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    loader = unbroken.data.ResumableLoader(Data(), batch_size=8, shuffle=True, seed=3, num_workers=workers)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "data": loader}


def train(run: Path, workers: int, point: str | None = None, losses: dict | None = None) -> dict:
    """Train to STEPS (resuming), raising once at ``point`` of step FAIL_AT; the final state."""
    state = build(workers)
    model, opt, sched, scaler, loader = (state[k] for k in ("model", "optimizer", "scheduler", "scaler", "data"))
    ckpt = unbroken.Checkpointer(run, save_every=SAVE_EVERY, keep_last=None,
                                 preemption=unbroken.Preemption(signals=(signal.SIGUSR1,)))
    ckpt.restore(state)
    losses = {} if losses is None else losses

    def at(where: str) -> None:
        if point == where and ckpt.progress.step + 1 == FAIL_AT:
            raise Boom(where)

    try:
        with ckpt.guard(state):
            batches = iter(loader)
            while ckpt.progress.step < STEPS:
                try:
                    x, y = next(batches)
                except StopIteration:
                    batches = iter(loader)
                    x, y = next(batches)
                model.train()
                loss = F.cross_entropy(model(x), y)
                at("forward")
                scaler.scale(loss).backward()
                at("backward")
                if point == "inside optimizer.step" and ckpt.progress.step + 1 == FAIL_AT:
                    HalfStepAdamW.fail = True
                scaler.step(opt)
                at("after optimizer.step")
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                at("after the bookkeeping")
                losses[ckpt.progress.step + 1] = loss.item()
                if point == "inside a save" and ckpt.progress.step + 1 == FAIL_AT + 1:  # step 6 saves
                    fail_next_write()
                if point == "inside a signal-triggered save" and ckpt.progress.step + 1 == FAIL_AT:
                    fail_next_write()
                    os.kill(os.getpid(), signal.SIGUSR1)
                ckpt.step(state, loss=loss.detach())
    finally:
        batches = None
        ckpt.close()
    return {k: v.clone() for k, v in model.state_dict().items()} | {
        f"opt/{i}/{k}": v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


def fail_next_write() -> None:
    real = persist.write_tensors

    def full_disk(staging, fname, entries):
        persist.write_tensors = real
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    persist.write_tensors = full_disk


POINTS = ["forward", "backward", "inside optimizer.step", "after optimizer.step", "after the bookkeeping",
          "inside a save", "inside a signal-triggered save"]


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "workers2"])
def reference(request, tmp_path_factory) -> tuple[int, dict, dict]:
    losses: dict = {}
    final = train(tmp_path_factory.mktemp("ref") / "run", request.param, losses=losses)
    return request.param, final, losses


@pytest.mark.parametrize("point", POINTS)
def test_an_exception_at_every_point_of_a_step_resumes_bitwise(reference, tmp_path: Path, point: str) -> None:
    workers, want, want_losses = reference
    run = tmp_path / "run"
    first: dict = {}
    with pytest.raises((Boom, OSError, SystemExit)) as err:
        train(run, workers, point, first)
    if point == "inside a signal-triggered save":
        assert isinstance(err.value, SystemExit) and err.value.code == EXIT_PREEMPTED
    names = list(unbroken.Checkpointer(run, preemption=None).checkpoints())
    emergency = [c for c in names if c.kind == "emergency"]
    for c in emergency:  # label, progress and content describe one instant
        assert c.name == f"step-{c.step:09d}" and c.progress["step"] == c.step
    if point in ("inside optimizer.step", "after optimizer.step"):
        assert not emergency  # torn: the previous committed checkpoint stays the newest
    elif point in ("forward", "backward"):
        assert [c.step for c in emergency] == [FAIL_AT - 1]
    elif point == "after the bookkeeping":
        assert [c.step for c in emergency] == [FAIL_AT]
    second: dict = {}
    got = train(run, workers, None, second)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), point
    for step, value in second.items():  # every step re-run after the resume logged the same loss
        assert want_losses[step] == value, (point, step)
    assert all(want_losses[s] == v for s, v in first.items())
