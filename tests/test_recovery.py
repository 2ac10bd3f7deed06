"""Recovery without relaunch: ``ckpt.recover(train, state, on=..., retries=...)``.

In-process tests check the rules (what propagates, how retries count, the rollback target, a
failed background save, stale iterators); end-to-end tests run tests/recovery_train.py as real
processes (one, and two ranks under torchrun on gloo) with injected transient faults and compare
the final parameters and optimizer state bitwise with the run that never failed.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

import unbroken
from unbroken.checkpoint import persist
from unbroken.data import ResumableLoader
from unbroken.errors import ConfigurationError
from unbroken.events import RolledBack
from unbroken.run.index.index import RunIndex
from unbroken.faults.recovery import LossSpike, Policy

SCRIPT = str(Path(__file__).parent / "recovery_train.py")
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


# ------------------------------------------------------------------ in-process


def build(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    return {"model": model, "optimizer": opt, "data": ResumableLoader(data, batch_size=4, shuffle=True, seed=2)}


def train(ckpt: unbroken.Checkpointer, state: dict[str, Any], steps: int, fail: dict[int, list[BaseException]],
          calls: list[int] | None = None, hook: Any = None, saved: dict[str, Any] | None = None):
    """A loop for recover(): ``fail[step]`` holds exceptions raised (one per visit) after that step's
    backward; ``hook(step)`` runs at each step's start; ``saved``: the state given to the Checkpointer
    (the same objects arranged another way), if not ``state``."""
    model, opt, loader = state["model"], state["optimizer"], state["data"]
    saved = state if saved is None else saved

    def fn() -> int:
        if calls is not None:
            calls.append(ckpt.progress.step)
        while ckpt.progress.step < steps:
            for x, y in loader:
                if hook is not None:
                    hook(ckpt.progress.step + 1)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()  # partial gradients exist when the step fails below
                if fail.get(ckpt.progress.step + 1):
                    raise fail[ckpt.progress.step + 1].pop(0)
                opt.step()
                opt.zero_grad()
                ckpt.step(saved, loss=loss.detach())
                if ckpt.progress.step >= steps:
                    break
        return ckpt.progress.step
    return fn


def params(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, st in state["optimizer"].state_dict()["state"].items():
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    state = build()
    with unbroken.Checkpointer(tmp_path_factory.mktemp("ref") / "run", save_every=3, preemption=None) as ckpt:
        ckpt.restore(state)
        assert ckpt.recover(train(ckpt, state, 10, {}), state, on=torch.OutOfMemoryError) == 10
    return params(state)


def rolled_back(ckpt: unbroken.Checkpointer) -> list[RolledBack]:
    seen: list[RolledBack] = []
    ckpt.events.subscribe(type("L", (), {"on_event": lambda self, e: isinstance(e, RolledBack) and seen.append(e)})())
    return seen


def test_transient_failures_roll_back_in_place_bitwise(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    state = build()
    fail = {5: [torch.OutOfMemoryError("oom")], 8: [FloatingPointError("nan"), FloatingPointError("nan")]}
    calls: list[int] = []
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, preemption=None) as ckpt:
        seen = rolled_back(ckpt)
        ckpt.restore(state)
        out = ckpt.recover(train(ckpt, state, 10, fail, calls), state, on=(torch.OutOfMemoryError, FloatingPointError))
    assert out == 10 and calls == [0, 3, 6, 6]  # fn called again after each rollback, from the restored step
    assert [(e.step_failed, e.restored_step, e.attempt) for e in seen] == [(5, 3, 1), (8, 6, 1), (8, 6, 2)]
    assert same(params(state), reference)


def test_without_dropping_the_gradients_it_would_not_be_exact(tmp_path: Path, reference: dict[str, torch.Tensor],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the failure comes after backward(), so the partial gradients must go."""
    monkeypatch.setattr("unbroken.faults.recovery.drop_gradients", lambda state: None)
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, preemption=None) as ckpt:
        ckpt.restore(state)
        ckpt.recover(train(ckpt, state, 10, {5: [torch.OutOfMemoryError("oom")]}), state, on=torch.OutOfMemoryError)
    assert not same(params(state), reference)


@pytest.mark.parametrize("arrange", ["nested", "list"])
def test_modules_and_optimizers_nested_in_the_state_lose_their_gradients_too(
        tmp_path: Path, reference: dict[str, torch.Tensor], arrange: str) -> None:
    """Issue 33 §3: the model and optimizer inside a mapping or a list of the state (before the fix only
    top-level ones dropped their gradients: the re-run step added to the failed step's)."""
    state = build()
    nets = {"model": state["model"], "optimizer": state["optimizer"]}
    saved = {"nets": nets if arrange == "nested" else [state["model"], state["optimizer"]], "data": state["data"]}
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, preemption=None) as ckpt:
        ckpt.restore(saved)
        out = ckpt.recover(train(ckpt, state, 10, {5: [torch.OutOfMemoryError("oom")]}, saved=saved), saved,
                           on=torch.OutOfMemoryError)
    assert out == 10 and same(params(state), reference)


def test_a_failure_between_unscale_and_update_of_a_grad_scaler_reruns_exactly(tmp_path: Path) -> None:
    """Issue 33 §3: a step that fails after ``scaler.unscale_(opt)`` (a NaN check on the unscaled
    gradients) left the scaler's per-optimizer stage at "unscaled": the re-run raised torch's own
    "unscale_() has already been called" error. Compared with the same loop never failing."""

    def run(where: Path, fail_at: int | None) -> dict[str, torch.Tensor]:
        state = build()
        state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        model, opt, loader, scaler = state["model"], state["optimizer"], state["data"], state["scaler"]
        failed = []

        with unbroken.Checkpointer(where, save_every=3, preemption=None) as ckpt:
            def fn() -> int:
                while ckpt.progress.step < 10:
                    for x, y in loader:
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                        scaler.scale(loss).backward()
                        scaler.unscale_(opt)
                        if ckpt.progress.step + 1 == fail_at and not failed:
                            failed.append(1)
                            raise FloatingPointError("nan in the unscaled gradients")
                        scaler.step(opt)
                        scaler.update()
                        opt.zero_grad()
                        ckpt.step(state, loss=loss.detach())
                        if ckpt.progress.step >= 10:
                            break
                return ckpt.progress.step

            ckpt.restore(state)
            assert ckpt.recover(fn, state, on=FloatingPointError) == 10
        assert bool(failed) == (fail_at is not None)
        return {**params(state), "scale": scaler.get_scale() * torch.ones(1)}

    assert same(run(tmp_path / "failed", 5), run(tmp_path / "never", None))


def test_an_exception_not_in_on_propagates_unchanged(tmp_path: Path) -> None:
    state, err = build(), KeyError("not recoverable")
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, preemption=None) as ckpt:
        seen = rolled_back(ckpt)
        ckpt.restore(state)
        with pytest.raises(KeyError) as got:
            ckpt.recover(train(ckpt, state, 10, {4: [err]}), state, on=(torch.OutOfMemoryError, FloatingPointError))
    assert got.value is err and not seen and ckpt.progress.step == 3


def test_retries_count_consecutive_failures_without_progress(tmp_path: Path) -> None:
    state = build()
    errors = [torch.OutOfMemoryError(f"oom {i}") for i in range(3)]
    fail = {2: [torch.OutOfMemoryError("a")], 4: [torch.OutOfMemoryError("b")], 7: list(errors)}
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, preemption=None) as ckpt:
        seen = rolled_back(ckpt)
        ckpt.restore(state)
        with pytest.raises(torch.OutOfMemoryError) as got:
            ckpt.recover(train(ckpt, state, 10, fail), state, on=torch.OutOfMemoryError, retries=2)
    # steps 2 and 4 are isolated faults (the run got past each): attempt 1 each; step 7 fails 3 times
    assert [(e.step_failed, e.attempt) for e in seen] == [(2, 1), (4, 1), (7, 1), (7, 2)]
    assert got.value is errors[2]


def test_a_guard_around_recover_saves_the_exact_emergency_checkpoint_once_retries_run_out(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=4, preemption=None) as ckpt:
        ckpt.restore(state)
        with pytest.raises(torch.OutOfMemoryError), ckpt.guard(state):
            ckpt.recover(train(ckpt, state, 10, {7: [torch.OutOfMemoryError("oom")] * 2}), state,
                         on=torch.OutOfMemoryError, retries=1)
        assert ckpt.last_saved is not None and (ckpt.last_saved.kind, ckpt.last_saved.step) == ("emergency", 6)
    state = build(seed=5)  # the relaunch: new objects
    with unbroken.Checkpointer(tmp_path / "run", save_every=4, preemption=None) as ckpt:
        assert ckpt.restore(state).step == 6
        assert train(ckpt, state, 10, {})() == 10
    assert same(params(state), reference)


def test_a_guard_never_commits_the_state_rollback_if_rejected(tmp_path: Path) -> None:
    """Issue 33 §3: the retries of a loss-spike rollback run out inside ``guard()``: the guard used to
    save the spiked state (the step boundary was marked) as an emergency checkpoint, and the relaunch
    resumed from the rejected weights. No checkpoint of step 5 may exist; the relaunch starts at 4."""
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=4, preemption=None) as ckpt:
        ckpt.restore(state)
        with pytest.raises(LossSpike, match="at step 5"), ckpt.guard(state):
            ckpt.recover(train(ckpt, state, 10, {}), state, on=torch.OutOfMemoryError,
                         rollback_if=lambda m: ckpt.progress.step == 5, retries=1)
        assert ckpt.last_saved is not None and ckpt.last_saved.step == 4, ckpt.last_saved
        assert all(c.step <= 4 for c in ckpt.checkpoints()), [(c.name, c.step) for c in ckpt.checkpoints()]
    with unbroken.Checkpointer(tmp_path / "run", save_every=4, preemption=None) as ckpt:
        assert ckpt.restore(build(seed=5)).step == 4


def test_policy_counts_a_failure_earlier_in_the_rerun_stretch_as_consecutive() -> None:
    p = Policy((Exception,), retries=3)
    assert [p.failure(s) for s in (10, 10, 8, 10, 11, 11, 30)] == [1, 2, 3, 4, 1, 2, 1]


def test_a_fresh_run_gets_a_rollback_target_before_fn_runs(tmp_path: Path) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=100, preemption=None) as ckpt:
        ckpt.restore(state)
        seen = rolled_back(ckpt)
        ckpt.recover(train(ckpt, state, 3, {2: [torch.OutOfMemoryError("oom")]}), state, on=torch.OutOfMemoryError)
    assert [(e.restored_step, e.checkpoint) for e in seen] == [(0, "step-000000000")]
    with unbroken.Checkpointer(tmp_path / "run", save_every=100, preemption=None) as ckpt:
        ckpt.restore(state)  # the newest: no save before fn
        assert ckpt.recover(lambda: "done", state, on=torch.OutOfMemoryError) == "done"
        assert [c.name for c in ckpt.checkpoints()] == ["step-000000000"]
        ckpt.step(state)  # the live state (step 1) is no checkpoint: saved first
        ckpt.recover(lambda: None, state, on=torch.OutOfMemoryError)
        assert [c.name for c in ckpt.checkpoints()] == ["step-000000001", "step-000000000"]


def test_a_failed_background_save_is_not_a_rollback_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          reference: dict[str, torch.Tensor]) -> None:
    monkeypatch.setenv("UNBROKEN_WRITER_PROCESS", "0")  # the failure is injected into this process's writes
    real = persist.write_tensors
    failed: list[int] = []

    def fail_once(staging, fname, entries):
        if not failed:
            failed.append(1)
            time.sleep(0.2)  # still in flight when step 7 raises
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(staging, fname, entries)

    def hook(step: int) -> None:  # the background save of step 6 fails; step 3's committed
        if step == 6 and not failed:
            assert ckpt.flush() is not None or ckpt.last_saved.step == 3  # step 3's save committed first
            monkeypatch.setattr(persist, "write_tensors", fail_once)

    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, preemption=None, async_save=True) as ckpt:
        seen = rolled_back(ckpt)
        ckpt.restore(state)
        ckpt.recover(train(ckpt, state, 10, {7: [torch.OutOfMemoryError("oom")]}, hook=hook), state,
                     on=torch.OutOfMemoryError)
    assert failed and [(e.step_failed, e.restored_step) for e in seen] == [(7, 3)]
    assert same(params(state), reference)


def test_an_iterator_started_before_the_rollback_is_refused(tmp_path: Path) -> None:
    state = build()
    it = iter(state["data"])  # outside fn: stale after the rollback
    fails = [torch.OutOfMemoryError("oom")]

    with unbroken.Checkpointer(tmp_path / "run", save_every=2, preemption=None) as ckpt:
        ckpt.restore(state)

        def fn() -> None:
            for x, _ in it:
                state["model"](x).sum().backward()
                state["optimizer"].step()
                ckpt.step(state)
                if ckpt.progress.step == 3 and fails:
                    raise fails.pop()
        with pytest.raises(RuntimeError, match="started before restore"):
            ckpt.recover(fn, state, on=torch.OutOfMemoryError)


def counted_job(run: Path, fail: set[int], spike_at: int = 0) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """Two epochs over ``ckpt.batches(range(...))`` (no ResumableLoader) inside ``ckpt.epochs``; the
    steps in ``fail`` raise once; a loss spike at ``spike_at`` (once) skips 2 items. Returns the final
    tensors and the item each step trained on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs = torch.randn(40, 4, generator=torch.Generator().manual_seed(3))
    state, seen = {"model": model, "optimizer": opt}, {}
    with unbroken.Checkpointer(run, save_every=3, preemption=None) as ckpt:
        ckpt.restore(state)

        def fn() -> None:
            for _ in ckpt.epochs(state, 2):
                for i in ckpt.batches(range(0, 40, 4)):
                    step = ckpt.progress.step + 1
                    loss = model(xs[i:i + 4]).pow(2).mean()
                    loss.backward()
                    if step in fail:
                        fail.discard(step)
                        raise FloatingPointError(f"step {step}")
                    opt.step()
                    opt.zero_grad()
                    seen[step] = i
                    ckpt.step(state, loss=loss.detach())
        spikes = [spike_at]
        ckpt.recover(fn, state, on=FloatingPointError, skip_batches=2,
                     rollback_if=lambda m: ckpt.progress.step in spikes and not spikes.remove(ckpt.progress.step))
    return params(state), seen


def test_ckpt_batches_serves_the_items_after_the_restored_position(tmp_path: Path) -> None:
    want, want_seen = counted_job(tmp_path / "ref", set())
    got, got_seen = counted_job(tmp_path / "run", {5, 12})  # 12: in the second epoch, back to step 9 in the first
    assert got_seen == want_seen and len(got_seen) == 20
    assert same(got, want)
    _, spiked = counted_job(tmp_path / "spike", set(), spike_at=4)  # back to step 3 (item 3), 2 items skipped
    assert [spiked[s] for s in range(1, 10)] == [0, 4, 8, 20, 24, 28, 32, 36, 0]


def test_loss_spike_rolls_back_skips_and_saves_the_new_position(tmp_path: Path) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, keep_last=None, preemption=None) as ckpt:
        seen = rolled_back(ckpt)
        ckpt.restore(state)
        spikes = iter([True])

        def spike(m: dict[str, Any]) -> bool:
            return ckpt.progress.step == 5 and next(spikes, False)
        ckpt.recover(train(ckpt, state, 8, {}), state, on=torch.OutOfMemoryError, rollback_if=spike, skip_batches=2)
    assert [(e.step_failed, e.restored_step, e.skipped_batches) for e in seen] == [(5, 3, 2)]
    assert unbroken.verify(tmp_path / "run" / "step-000000003-2").kind == "rollback"
    after = unbroken.load(tmp_path / "run" / "step-000000003-2")
    assert after["data"]["position"] == (3 + 2) * 4  # 3 steps of 4 samples, then 2 batches skipped


def test_loss_spike_beyond_the_retries_raises_and_without_recover_nothing_happens(tmp_path: Path) -> None:
    state = build()
    with unbroken.Checkpointer(tmp_path / "run", save_every=3, preemption=None) as ckpt:
        ckpt.restore(state)
        with pytest.raises(LossSpike, match="at step 5"):
            ckpt.recover(train(ckpt, state, 8, {}), state, on=torch.OutOfMemoryError,
                         rollback_if=lambda m: ckpt.progress.step == 5, retries=1)
        assert train(ckpt, state, 8, {})() == 8  # outside recover(): no predicate


@pytest.mark.parametrize("kwargs,match", [
    (dict(on=BaseException), "subclasses of"), (dict(on=()), "exception class"), (dict(on=[KeyError, 3]), "tuple"),
    (dict(on=KeyError, retries=-1), "retries"), (dict(on=KeyError, retries=True), "retries"),
    (dict(on=KeyError, skip_batches=3), "rollback_if"), (dict(on=KeyError, rollback_if=3), "function"),
])
def test_arguments_are_checked_before_anything_runs(tmp_path: Path, kwargs: dict, match: str) -> None:
    ran: list[int] = []
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        with pytest.raises(ConfigurationError, match=match):
            ckpt.recover(lambda: ran.append(1), build(), **kwargs)
    assert not ran and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ end to end, real processes


def job(base: Path, *extra: str) -> list[str]:
    return [SCRIPT, "--run-dir", str(base / "run"), "--out", str(base / "out"), *extra]


def run(args: list[str], ranks: int = 1, timeout: float = 300, restarts: int = 0,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        f"--max-restarts={restarts}", *args]
    return subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=timeout)


def final(base: Path) -> dict[str, torch.Tensor]:
    return load_file(str(base / "out" / "final.safetensors"))


def last_losses(base: Path, rank: int = 0) -> dict[int, tuple[float, list[int]]]:
    rows = [json.loads(x) for x in (base / "out" / f"losses-r{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["samples"]) for r in rows}


def rollbacks(base: Path) -> list[tuple[int, int, int, str]]:
    with RunIndex(str(base / "run"), readonly=True) as idx:
        events = idx.events("rolled_back")
    assert all(e["data"]["tier"] in ("local", "ram") for e in events), events  # the tier each rollback read from
    return [(e["step"], e["data"]["restored_step"], e["data"]["attempt"], e["message"].split(":")[0]) for e in events]


@pytest.fixture(scope="module")
def ref1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("ref1")
    done = run(job(base))
    assert done.returncode == 0, done.stderr
    return base


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("extra", [(), ("--async-save",)], ids=["sync", "async"])
def test_e2e_transient_faults_bitwise(ref1: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    done = run(job(tmp_path, "--faults", "7:oom,12:oombw,13:nan:2,23:oom", *extra))
    assert done.returncode == 0, done.stderr
    assert same(final(tmp_path), final(ref1))
    assert last_losses(tmp_path) == last_losses(ref1)
    assert rollbacks(tmp_path) == [(7, 5, 1, "OutOfMemoryError"), (12, 10, 1, "OutOfMemoryError"),
                                   (13, 10, 1, "FloatingPointError"), (13, 10, 2, "FloatingPointError"),
                                   (23, 20, 1, "OutOfMemoryError")]
    assert done.stderr.count("rolled back to") == 5
    with RunIndex(str(tmp_path / "run"), readonly=True) as idx:
        assert idx.continuity("loss").verdict == "continuous"  # each rollback a segment; re-run losses equal
    shown = subprocess.run([sys.executable, "-m", "unbroken.cli", "events", str(tmp_path / "run"), "--kind",
                            "rolled_back"], env=ENV, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and shown.stdout.count("rolled_back") == 5, shown


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_retries_exhausted_propagates_and_a_relaunch_resumes_exactly(ref1: Path, tmp_path: Path) -> None:
    done = run(job(tmp_path, "--faults", "13:oom:4", "--retries", "3"))
    assert done.returncode == 1
    assert "torch.OutOfMemoryError: CUDA out of memory (injected)" in done.stderr
    assert rollbacks(tmp_path) == [(13, 10, a, "OutOfMemoryError") for a in (1, 2, 3)]
    again = run(job(tmp_path, "--faults", "13:oom:4", "--retries", "3"))  # the 4 faults fired: transient now
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr and "step-000000010" in again.stderr
    assert same(final(tmp_path), final(ref1))
    assert last_losses(tmp_path) == last_losses(ref1)


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_an_exception_not_in_on_propagates(ref1: Path, tmp_path: Path) -> None:
    done = run(job(tmp_path, "--faults", "9:key"))
    assert done.returncode == 1 and "KeyError: 'injected'" in done.stderr
    assert rollbacks(tmp_path) == [] and "rolled back" not in done.stderr
    again = run(job(tmp_path, "--faults", "9:key"))
    assert again.returncode == 0, again.stderr
    assert same(final(tmp_path), final(ref1))


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_loss_spike_skip_is_reproduced_by_a_relaunch(ref1: Path, tmp_path: Path) -> None:
    bad = last_losses(ref1)[12][1][0]  # a sample of step 12: its batch spikes
    spike = ("--spike-sample", str(bad), "--rollback-if", "--skip-batches", "3")
    a = run(job(tmp_path / "a", *spike))
    assert a.returncode == 0, a.stderr
    with RunIndex(str(tmp_path / "a" / "run"), readonly=True) as idx:
        [event] = idx.events("rolled_back")
        kinds = {c["name"]: c["kind"] for c in idx.checkpoints()}
    assert (event["step"], event["checkpoint"], event["data"]["skipped_batches"]) == (12, "step-000000010", 3)
    assert "LossSpike" in event["message"] and kinds["step-000000010-2"] == "rollback"
    ref, got = last_losses(ref1), last_losses(tmp_path / "a")
    assert all(got[s][1] == ref[s + 3][1] for s in range(11, 28))  # three batches skipped after step 10
    assert all(bad not in s for step, (_, s) in got.items() if step > 10)
    assert not same(final(tmp_path / "a"), final(ref1))  # the skip changed the run (the test is not vacuous)
    # the same job, SIGKILLed at the first step after the rollback, relaunched: the same run
    b = run(job(tmp_path / "b", *spike, "--faults", "11:kill:1:1"))
    assert b.returncode == -9, b.stderr
    b = run(job(tmp_path / "b", *spike, "--faults", "11:kill:1:1"))
    assert b.returncode == 0 and "resumed from" in b.stderr and "step-000000010-2" in b.stderr, b.stderr
    assert same(final(tmp_path / "b"), final(tmp_path / "a"))
    assert last_losses(tmp_path / "b") == got


@pytest.fixture(scope="module")
def ref2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("ref2")
    done = run(job(base), ranks=2)
    assert done.returncode == 0, done.stderr
    return base


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_two_ranks_roll_back_to_the_same_step_bitwise(ref2: Path, tmp_path: Path) -> None:
    # an OOM on both ranks; a NaN loss on rank 0 only, made global by the job's all-reduced flag
    done = run(job(tmp_path / "f", "--faults", "7:oom,9:nan@0,17:oom"), ranks=2)
    assert done.returncode == 0, done.stderr
    assert same(final(tmp_path / "f"), final(ref2))
    for rank in (0, 1):
        assert last_losses(tmp_path / "f", rank) == last_losses(ref2, rank)
    assert rollbacks(tmp_path / "f") == [(7, 5, 1, "OutOfMemoryError"), (9, 5, 1, "FloatingPointError"),
                                         (17, 15, 1, "OutOfMemoryError")]
    out = done.stdout + done.stderr
    assert out.count("step 9: FloatingPointError") == 2  # logged by both ranks


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_one_rank_raising_alone_goes_to_the_relaunch_path(ref2: Path, tmp_path: Path) -> None:
    """Rank 1 waits in the job's all-reduce: it cannot join; rank 0 re-raises after the bounded
    agreement, torchrun restarts both ranks, and the restart resumes exactly."""
    env = dict(ENV, UNBROKEN_RECOVER_AGREE_S="5")
    done = run(job(tmp_path, "--faults", "7:oom@0"), ranks=2, restarts=1, env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "not every rank joined the rollback" in out and "torch.OutOfMemoryError" in out
    assert "resumed from" in out and rollbacks(tmp_path) == []
    assert same(final(tmp_path), final(ref2))
    for rank in (0, 1):
        assert last_losses(tmp_path, rank) == last_losses(ref2, rank)


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_an_oom_inside_ddp_backward_goes_to_the_relaunch_path(ref2: Path, tmp_path: Path) -> None:
    """Documented limit: after an exception in the middle of DDP's backward its reducer still waits for
    the rest of the reduction, so the re-run's first forward raises DDP's RuntimeError (not in ``on``):
    it propagates, torchrun restarts both ranks, and the restart resumes exactly."""
    done = run(job(tmp_path, "--faults", "7:oombw"), ranks=2, restarts=1)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "Expected to have finished reduction in the prior iteration" in out and "resumed from" in out
    assert [r[0] for r in rollbacks(tmp_path)] == [7]
    assert same(final(tmp_path), final(ref2))


@pytest.mark.slow
@pytest.mark.e2e
def test_e2e_two_ranks_loss_spike_on_one_rank_rolls_back_both_and_a_relaunch_reproduces_it(
        ref2: Path, tmp_path: Path) -> None:
    bad = last_losses(ref2, 1)[12][1][0]  # a sample rank 1 trains on at step 12: only its loss spikes
    spike = ("--spike-sample", str(bad), "--rollback-if", "--skip-batches", "3")
    a = run(job(tmp_path / "a", *spike), ranks=2)
    assert a.returncode == 0, a.stderr
    out = a.stdout + a.stderr
    assert "rollback_if was true at step 12 (loss=" in out and "at step 12 on another rank" in out
    assert [(r[0], r[1]) for r in rollbacks(tmp_path / "a")][0] == (12, 10)
    for rank in (0, 1):
        ref, got = last_losses(ref2, rank), last_losses(tmp_path / "a", rank)
        assert got[11][1] == ref[14][1]  # both ranks skipped the same three global batches
    assert not same(final(tmp_path / "a"), final(ref2))
    # rank 0 SIGKILLed at the first step after the rollback; torchrun restarts both: the same run
    b = run(job(tmp_path / "b", *spike, "--faults", "11:kill:1:1@0"), ranks=2, restarts=1)
    assert b.returncode == 0 and "step-000000010-2" in b.stdout + b.stderr, b.stderr
    assert same(final(tmp_path / "b"), final(tmp_path / "a"))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(unbroken, "RamTier"), reason="the RAM tier (issue 26 §1) is not on this branch yet")
def test_e2e_rollbacks_read_the_ram_tier(ref1: Path, tmp_path: Path) -> None:
    """With a RAM tier the rollback goes through the same restore path, so it reads memory."""
    ram = tmp_path / "shm"
    done = run(job(tmp_path, "--ram", "--faults", "7:oom,13:nan"), env=dict(ENV, UNBROKEN_RAM_ROOT=str(ram)))
    assert done.returncode == 0, done.stderr
    assert [r[:2] for r in rollbacks(tmp_path)] == [(7, 5), (13, 10)]
    with RunIndex(str(tmp_path / "run"), readonly=True) as idx:  # the index names the tier read (issue 33 §5)
        assert [e["data"]["tier"] for e in idx.events("rolled_back")] == ["ram", "ram"]
    resumed = [line for line in done.stderr.splitlines() if "resumed from" in line]
    assert len(resumed) == 2 and all(str(ram) in line for line in resumed), resumed
    assert same(final(tmp_path), final(ref1))
