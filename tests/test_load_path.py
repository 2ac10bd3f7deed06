"""The load path: large tensor files are mapped and hashed as they stream in; what a restore
puts into the live objects never keeps a view of the checkpoint file (its own memory), so
the file changing afterwards changes nothing, and both read paths load the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.store import readfile


def build() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 4 MB of weights: the files are mapped
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def test_restored_objects_own_their_memory_and_ignore_later_changes_to_the_file(tmp_path: Path) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        info = ckpt.save(state)
    assert info is not None
    files = sorted((tmp_path / "run" / info.name).glob("*.safetensors"))
    assert max(f.stat().st_size for f in files) >= readfile.MMAP_MIN
    fresh = {"model": torch.nn.Linear(1024, 1024), "optimizer": None}
    fresh["optimizer"] = torch.optim.AdamW(fresh["model"].parameters(), lr=0.01)
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        assert ckpt.restore(fresh) is not None
    want = [t.clone() for t in moments(state["optimizer"])]
    got = moments(fresh["optimizer"])
    assert got
    for f in files:  # the file is rewritten in place (by someone else): the live state does not follow
        with open(f, "r+b") as fh:
            fh.seek(64)
            fh.write(b"\xff" * (f.stat().st_size - 64))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(fresh["model"].weight, state["model"].weight)


@pytest.mark.parametrize("mapped", [True, False])
def test_both_read_paths_load_the_same_bytes_and_catch_a_flipped_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool) -> None:
    if not mapped:
        monkeypatch.setenv("UNBROKEN_NO_MMAP", "1")
    state = {"w": torch.randn(3_000_000), "b": torch.arange(10)}
    unbroken.save(tmp_path / "c", state)
    got = unbroken.load(tmp_path / "c")
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    f = max((tmp_path / "c").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 1]))
    with pytest.raises(unbroken.CorruptCheckpointError, match="checksum mismatch"):
        unbroken.load(tmp_path / "c")


def test_large_files_written_in_parallel_round_trip_and_a_failure_commits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parallel writer (large local files written by two threads at once, threshold
    lowered here) produces the same checkpoint; one file failing aborts the whole save."""
    import errno
    import threading

    from unbroken.checkpoint import persist

    monkeypatch.setattr(persist, "PARALLEL_MIN", 1)
    real, threads = persist.write_tensors, set()

    def record(staging, fname, entries):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return real(staging, fname, entries)

    monkeypatch.setattr(persist, "write_tensors", record)
    state = {"a": torch.randn(100_000), "b": {"x": torch.randn(50_000)}, "c": torch.arange(7)}
    unbroken.save(tmp_path / "ok", state)
    got = unbroken.load(tmp_path / "ok")
    assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"]["x"], state["b"]["x"])
    assert any(name.startswith("unbroken-write") for name in threads)

    def fail_b(staging, fname, entries):  # type: ignore[no-untyped-def]
        if "-b" in fname:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(staging, fname, entries)

    monkeypatch.setattr(persist, "write_tensors", fail_b)
    with pytest.raises(unbroken.StorageError, match="No space"):
        unbroken.save(tmp_path / "bad", state)
    assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".staging")]


def test_load_into_a_plain_state_reads_a_checkpointers_checkpoint_without_its_lock(tmp_path: Path) -> None:
    """An evaluation job loads a training run's checkpoint with ``unbroken.load(path, state)``,
    strictly, while the training still holds the run: the Checkpointer's own part is left out
    and no lock is taken."""
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        ckpt.progress.step = 3
        info = ckpt.save(state)
        assert info is not None
        fresh = {"model": torch.nn.Linear(1024, 1024)}
        fresh["optimizer"] = torch.optim.AdamW(fresh["model"].parameters(), lr=0.01)
        unbroken.load(tmp_path / "run" / info.name, fresh)  # strict, while the run is held
    assert torch.equal(fresh["model"].weight, state["model"].weight)
    raw = unbroken.load(tmp_path / "run" / info.name)
    assert raw["__unbroken__"]["progress"]["step"] == 3  # without a state, everything


@pytest.mark.parametrize("change", ["shape", "dtype", "missing key", "optimizer class", "scheduler class"])
def test_a_mismatched_restore_fails_before_changing_anything(tmp_path: Path, change: str) -> None:
    """Module.load_state_dict copies the matching tensors before it raises (a half-restored
    model) and casts dtypes silently; Adam moments restored into SGD fail only at the next step;
    a LambdaLR state restored into StepLR changes the schedule. All refused up front."""
    def make(width: int = 8, dtype: torch.dtype = torch.float32, opt: str = "adam", sched: str = "lambda",
             extra: bool = False) -> dict:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2)).to(dtype)
        if extra:
            model.register_buffer("extra", torch.zeros(3))
        o = torch.optim.AdamW(model.parameters()) if opt == "adam" else torch.optim.SGD(model.parameters(), lr=0.1)
        s = (torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0) if sched == "lambda"
             else torch.optim.lr_scheduler.StepLR(o, 10))
        return {"model": model, "optimizer": o, "scheduler": s}

    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        ckpt.save(make(dtype=torch.float64 if change == "dtype" else torch.float32))
    kwargs = {"shape": dict(width=16), "dtype": {}, "missing key": dict(extra=True),
              "optimizer class": dict(opt="sgd"), "scheduler class": dict(sched="step")}[change]
    live = make(**kwargs)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in live["model"].parameters():
            p.normal_()
    before = {k: v.clone() for k, v in live["model"].state_dict().items()}
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        with pytest.raises(unbroken.StateMismatchError):
            ckpt.restore(live)
        assert ckpt.progress.step == 0
    assert all(torch.equal(v, before[k]) for k, v in live["model"].state_dict().items())  # untouched


@pytest.mark.parametrize("live_state", ["matching", "aliased", "view", "other shape", "own state_dict"])
def test_an_optimizer_with_state_is_restored_into_its_own_tensors_where_they_fit(
        tmp_path: Path, live_state: str) -> None:
    """Restoring into an optimizer that already has state copies the saved state into the
    tensors it holds (no fresh memory), like a module's parameters; a live tensor that cannot
    take it without harm (two entries sharing one tensor, a view into a larger buffer, another
    shape) is left alone and the saved value gets memory of its own, and so is every tensor of
    an optimizer with its own ``state_dict`` (a wrapper). Either way the result is the saved
    state, and it never follows the file."""
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        info = ckpt.save(state)
    assert info is not None
    fresh = build()  # stepped: it has state (other values, same shapes)
    opt = fresh["optimizer"]
    with torch.no_grad():
        for t in moments(opt):
            t.fill_(7.0)
    p = opt.param_groups[0]["params"][0]
    buffer = torch.full((2 * p.numel(),), 3.0)
    if live_state == "aliased":  # two entries, one tensor: copying both into it would lose one
        opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg"]
    elif live_state == "view":  # a view into a buffer that holds something else too
        opt.state[p]["exp_avg"] = buffer[:p.numel()].view_as(p)
    elif live_state == "other shape":
        opt.state[p]["exp_avg"] = torch.zeros(3)
    elif live_state == "own state_dict":
        opt.__class__ = type("Wrapped", (torch.optim.AdamW,), {"state_dict": lambda o: torch.optim.AdamW.state_dict(o)})
    held = {(i, k): t for i, s in enumerate(opt.state.values()) for k, t in s.items()}
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        assert ckpt.restore(fresh) is not None
    want = state["optimizer"].state_dict()["state"]
    got = opt.state_dict()["state"]
    assert set(got) == set(want)
    for i in want:
        for k in want[i]:
            assert torch.equal(got[i][k], want[i][k]), (i, k)
    kept = {(i, k) for i, s in enumerate(opt.state.values()) for k, t in s.items() if t is held[(i, k)]}
    unfit = {"matching": set(), "aliased": {(0, "exp_avg_sq")}, "own state_dict": set(held)}.get(
        live_state, {(0, "exp_avg")})
    assert kept == set(held) - unfit  # the first entry takes the shared tensor, the second its own memory
    assert torch.equal(buffer, torch.full_like(buffer, 3.0))  # the buffer a live view was in is untouched
    for f in (tmp_path / "run" / info.name).glob("*.safetensors"):  # rewritten: the live state does not follow
        with open(f, "r+b") as fh:
            fh.seek(64)
            fh.write(b"\xff" * (f.stat().st_size - 64))
    for i in want:
        for k in want[i]:
            assert torch.equal(got[i][k], want[i][k]), (i, k)
