"""The post-resume probe: equal after a right restore, different after a wrong one."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken
from unbroken.checkpointer.probe import compare, run_probe

BATCH = (torch.arange(32.0).reshape(8, 4) / 10, torch.arange(8.0).reshape(8, 1) / 8)


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def make(with_scheduler: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.9**epoch)
    state = {"model": model, "optimizer": opt}
    if with_scheduler:
        state["scheduler"] = sched
    probe = unbroken.probe_step(model, opt, loss_fn, BATCH, scheduler=sched)
    return model, opt, sched, state, probe


def train(run: Path, steps: int, with_scheduler: bool = True) -> unbroken.Checkpointer:
    model, opt, sched, state, probe = make(with_scheduler)
    ckpt = unbroken.Checkpointer(run, save_every=5, preemption=None, probe=probe)
    ckpt.restore(state)
    g = torch.Generator().manual_seed(ckpt.progress.step)
    while ckpt.progress.step < steps:
        loss_fn(model, (torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ckpt.step(state)
    return ckpt


def test_probe_is_equal_after_a_right_restore(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train(tmp_path / "run", 10).close()
    caplog.set_level(logging.INFO, logger="unbroken")
    _, _, _, state, probe = make()
    ckpt = unbroken.Checkpointer(tmp_path / "run", preemption=None, probe=probe)
    ckpt.restore(state)
    assert ckpt.probe_report is not None and ckpt.probe_report.status == "equal", ckpt.probe_report
    assert set(ckpt.probe_report.saved) == {"loss", "loss_after", "lr_next0"}
    assert any("probe equal" in r.getMessage() for r in caplog.records)


def test_probe_detects_a_forgotten_scheduler(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train(tmp_path / "run", 10).close()
    _, _, _, state, probe = make(with_scheduler=False)  # the scheduler is left out of the state
    ckpt = unbroken.Checkpointer(tmp_path / "run", preemption=None, probe=probe, strict=False)
    ckpt.restore(state)
    report = ckpt.probe_report
    assert report is not None and report.status == "different", report
    assert report.saved["lr_next0"] != report.now["lr_next0"]
    assert report.saved["loss"] == report.now["loss"]  # the weights themselves are right
    assert any(r.levelno == logging.ERROR and "probe different" in r.getMessage() for r in caplog.records)


def test_probe_detects_wrong_weights(tmp_path: Path) -> None:
    train(tmp_path / "run", 10).close()
    model, _, _, state, probe = make()
    ckpt = unbroken.Checkpointer(tmp_path / "run", preemption=None, probe=probe)
    ckpt.restore(state)
    with torch.no_grad():
        model[0].weight.add_(1e-3)
    assert compare(ckpt.probe_report.saved, run_probe(probe)).status == "different"


def test_probe_does_not_disturb_rng_or_state() -> None:
    model, opt, sched, _, probe = make()
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    run_probe(probe)
    after_probe = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    assert after_probe == (torch.rand(1).item(), random.random(), np.random.rand())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert sched.last_epoch == 0 and not opt.state


def test_compare_tolerance() -> None:
    assert compare({"a": 1.0}, {"a": 1.0}).status == "equal"
    assert compare({"a": 1.0}, {"a": 1.0 + 1e-9}).status == "within tolerance"
    assert compare({"a": 1.0}, {"a": 1.1}).status == "different"
    assert compare({"a": float("nan")}, {"a": float("nan")}).status == "equal"
    assert compare({"a": 1.0}, {"b": 1.0}).status == "different"
