"""Lazy snapshots (``Checkpointer(..., async_save="lazy")``): the optimizer's tensors are copied
in the background during the next forward/backward, the next ``optimizer.step()`` waits for
that copy, everything forward changes is copied at the save point, and a tensor changed
outside the optimizer step in that window fails the save loudly instead of tearing it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken.checkpoint.background.lazy import step_only_storages
from unbroken.checkpoint.snapshot import Snapshot, Snapshotter, storage_key


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    model[0].bias.requires_grad_(False)  # a frozen parameter no optimizer updates
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return {"model": model, "optimizer": opt}


def forward_backward(state: dict[str, Any]) -> None:
    state["model"](torch.randn(8, 16)).pow(2).mean().backward()


def one_step(state: dict[str, Any]) -> None:
    forward_backward(state)
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def live(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optimizer"].state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": v.clone() for k, v in s.items()})
    return out


def saved(path: Path) -> dict[str, torch.Tensor]:
    state = build()
    unbroken.load(path, state, strict=False)
    return live(state)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_only_what_the_optimizer_steps_is_deferred() -> None:
    state = build()
    one_step(state)
    forward_backward(state)  # gradients exist at the save point
    model = state["model"]
    snap = Snapshotter(copy=True).capture({"model": model, "optimizer": state["optimizer"],
                                           "grads": [p.grad for p in model.parameters() if p.grad is not None]},
                                          defer=step_only_storages(state))
    deferred = {key.split(":", 1)[1] for _, _, key in snap.deferred}
    trained = {f"model/{n}" for n, p in model.named_parameters() if p.requires_grad}
    moments = {k for k in deferred if k.startswith("optimizer/")}
    assert trained <= deferred and len(moments) == 3 * len(trained)  # step, exp_avg, exp_avg_sq
    assert deferred == trained | moments
    # eager: BatchNorm statistics (forward changes them), the frozen bias, the gradients
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked", "0.bias")) or
                   k.startswith("grads/") for k in deferred)
    # a deferred tensor's staging buffer is reserved, not yet written
    buf, src, _ = snap.deferred[0]
    assert buf.data_ptr() != src.data_ptr() and storage_key(src) in step_only_storages(state)


def test_capture_defers_only_with_a_copying_snapshotter() -> None:
    state = build()
    with pytest.raises(ValueError, match="copy=True"):
        Snapshotter().capture({"model": state["model"]}, defer=step_only_storages(state))


def test_the_next_optimizer_step_waits_for_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deferred copy is slowed to 0.4 s: the optimizer step right after the save would change
    the parameters long before it is made, unless the step pre-hook holds it. Meanwhile forward
    changes the BatchNorm statistics, which the checkpoint must hold as of the save point."""
    real, copies = Snapshot.complete, []

    def slow(self: Snapshot) -> None:
        if self.deferred:
            time.sleep(0.4)
            copies.append(time.monotonic())
        real(self)

    monkeypatch.setattr(Snapshot, "complete", slow)
    state = build()
    expected: dict[int, dict[str, torch.Tensor]] = {}
    stepped: list[float] = []
    with unbroken.Checkpointer(tmp_path / "run", save_every=2, keep_last=None, preemption=None,
                               async_save="lazy") as ckpt:
        ckpt.restore(state)
        for _ in range(6):
            forward_backward(state)
            state["optimizer"].step()
            stepped.append(time.monotonic())
            state["optimizer"].zero_grad()
            ckpt.step(state)
            if ckpt.progress.step % 2 == 0:
                expected[ckpt.progress.step] = live(state)
    assert len(copies) == 3
    # each copy was made before the optimizer step that followed its save point
    assert copies[0] < stepped[2] and copies[1] < stepped[4]
    for step, want in expected.items():
        assert same(saved(tmp_path / "run" / f"step-{step:09d}"), want), step


def test_a_tensor_changed_outside_the_optimizer_step_fails_the_save_loudly(tmp_path: Path) -> None:
    state = build()
    run = tmp_path / "run"
    with unbroken.Checkpointer(run, save_every=1, keep_last=None, preemption=None, async_save="lazy") as ckpt:
        ckpt.restore(state)
        one_step(state)
        ckpt.step(state)  # step 1: saved lazily; the next optimizer step judges it intact
        one_step(state)
        ckpt.step(state)  # step 2
        with torch.no_grad():
            state["model"][3].weight.mul_(0.5)  # e.g. an EMA written into the optimized weights
        with pytest.raises(unbroken.UnbrokenError, match=r"model/3\.weight.*not committed"):
            one_step(state)
            ckpt.step(state)
        assert ckpt.progress.step <= 3  # raised by step 3 (at its start, or by its save's wait)
        ckpt.progress.step = 3
        one_step(state)
        assert ckpt.step(state) is None and ckpt.flush().step == 4  # the next save works
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))
    assert "step-000000002" not in names and {"step-000000001", "step-000000004"} <= set(names)
    assert not [p for p in run.iterdir() if p.name.startswith(".staging-")]
    for name in names:
        unbroken.verify(run / name)


def test_a_restore_waits_for_the_lazy_save_in_flight(tmp_path: Path) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", keep_last=None, preemption=None, async_save="lazy") as ckpt:
        ckpt.restore(state)
        one_step(state)
        ckpt.progress.step = 1
        want = live(state)
        assert ckpt.save(state) is None
        info = ckpt.restore(state)  # loads into the very tensors the save is still copying
        assert info is not None and info.step == 1 and same(live(state), want)
