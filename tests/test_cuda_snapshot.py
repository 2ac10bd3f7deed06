"""Background and lazy saves of a model on a GPU: copies on a side stream into pinned host
buffers, the training stream waiting (on the GPU) only where it must. These tests need CUDA
and are skipped without it; the CPU paths are covered by test_async_save and test_lazy_snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256)).cuda()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}


def one_step(state: dict[str, Any]) -> None:
    state["model"](torch.randn(64, 256, device="cuda")).pow(2).mean().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()


def live(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().cpu().clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optimizer"].state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": v.detach().cpu().clone() for k, v in s.items()})
    return out


@pytest.mark.parametrize("mode", [False, True, "lazy"])
def test_every_gpu_checkpoint_holds_exactly_its_steps_state(tmp_path: Path, mode: Any) -> None:
    state = build()
    expected = {}
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, keep_last=None, preemption=None,
                               async_save=mode) as ckpt:
        ckpt.restore(state)
        for _ in range(12):
            one_step(state)  # queued on the GPU right after the save point
            ckpt.step(state)
            if ckpt.progress.step % 3 == 0:
                expected[ckpt.progress.step] = live(state)
    for step, want in expected.items():
        fresh = build()
        unbroken.load(tmp_path / "run" / f"step-{step:09d}", fresh, strict=False)
        got = live(fresh)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), step


def test_a_gpu_tensor_changed_in_the_lazy_window_fails_the_save(tmp_path: Path) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=1, keep_last=None, preemption=None,
                               async_save="lazy") as ckpt:
        ckpt.restore(state)
        one_step(state)
        ckpt.step(state)
        with torch.no_grad():
            state["model"][0].weight.mul_(1.0)
        with pytest.raises(unbroken.UnbrokenError, match="changed between the save point"):
            one_step(state)
            ckpt.step(state)
            ckpt.flush()


def test_shared_staging_is_page_locked_and_written_by_the_writer_process(tmp_path: Path) -> None:
    """The writer process's staging (unbroken.checkpoint.background.shm) is registered with CUDA: device copies into it
    are asynchronous (``is_pinned``), and the checkpoint holds the step's exact values."""
    from unbroken.checkpoint.background.shm import SharedArena
    from unbroken.checkpoint.snapshot import Snapshotter

    arena = SharedArena(pin=True)
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    snap = Snapshotter(copy=True, arena=arena).capture({"t": t})
    [entry] = snap.files["t00-t.safetensors"]
    assert entry.tensor.is_pinned() and arena.locate(entry.tensor) is not None
    snap.complete()
    assert torch.equal(entry.tensor, t.cpu())
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=2, preemption=None, async_save=True) as ckpt:
        ckpt.restore(state)
        for _ in range(4):
            one_step(state)
            ckpt.step(state)
        want = live(state)
        assert ckpt.flush().step == 4
    fresh = build()
    unbroken.load(tmp_path / "run" / "step-000000004", fresh, strict=False)
    got = live(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want)
