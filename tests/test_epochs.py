"""The epoch boundary (:mod:`unbroken.checkpointer.epochs`): epoch loops resume exactly wherever they stopped.

A small loop — dropout, a ``ResumableLoader``, an evaluation over a plain ``DataLoader`` (its
iterator draws from the global RNG), ``StepLR`` stepped per epoch — is trained once without
interruption, then interrupted at one point (inside an epoch, at an epoch's last step, at the
start of the evaluation, after ``scheduler.step()``, a preemption signal during the
evaluation) and resumed by a fresh set of objects from the run folder, as a new process would.
Every step's loss, every evaluation and the final model, optimizer and scheduler must be
bitwise the uninterrupted run's; each epoch's evaluation must count once in the result.

The counted loop of ``word_language_model`` (no ``DataLoader``, no optimizer, a hidden state
carried across batches, the LR annealed on the validation loss) is covered the same way with
``ckpt.batches()`` and ``unbroken.Vars``; the upstream-shaped scripts themselves are killed
with real signals in ``test_upstream_loops.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import unbroken
import unbroken.data
from unbroken.faults import EXIT_PREEMPTED
from unbroken.checkpointer.manager import UnbrokenWarning
from unbroken.policies import AtEpochEnd

# resumed at the last step of epoch 0, the new process's optimizer has not stepped before the epoch's
# scheduler.step(): torch warns about the order (docs/your-loop.md, Limits)
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before:UserWarning")

EPOCHS, N, B, SAVE_EVERY = 3, 24, 4, 3  # 6 steps an epoch: epoch ends at steps 6, 12, 18 (all saved)


class Killed(BaseException):
    """The simulated end of a process (nothing of its live state survives: objects are rebuilt)."""


def data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N + 8, 5, generator=g), torch.randint(0, 3, (N + 8,), generator=g)
    return TensorDataset(x[:N], y[:N]), TensorDataset(x[N:], y[N:])


def train(run: Path, shape: str, stop: str | None = None, log: dict | None = None, trigger: bool = False,
          guarded: bool = False, save_every: int = SAVE_EVERY) -> dict:
    """Train to the end (resuming from ``run``), raising :class:`Killed` at ``stop`` (``"step:N"``,
    ``"eval:E"``, ``"sched:E"``; with ``guarded``, a ``RuntimeError`` inside ``ckpt.guard``) or
    sending SIGUSR1 (``"signal:E"``: during epoch E's evaluation)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_set, val_set = data()
    loader = unbroken.data.ResumableLoader(train_set, batch_size=B, shuffle=True, seed=2)
    val_loader = DataLoader(val_set, batch_size=4)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}
    ckpt = unbroken.Checkpointer(run, save_every=save_every, keep_last=None, trigger=AtEpochEnd() if trigger else None,
                                 preemption=unbroken.Preemption(signals=(signal.SIGUSR1,)))
    log = {"loss": {}, "val": [], "evals": 0} if log is None else log
    ckpt.restore(state)

    def at(point: str) -> None:
        if stop == point:
            raise RuntimeError(point) if guarded else Killed(point)
        if stop == "signal:" + point.split(":")[1] and point.startswith("eval:"):
            os.kill(os.getpid(), signal.SIGUSR1)  # handled at the end of the epoch

    def one_epoch(epoch: int) -> None:
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(state, loss=loss)
            log["loss"].setdefault(ckpt.progress.step, []).append(loss.item())
            at(f"step:{ckpt.progress.step}")
        at(f"eval:{epoch}")
        model.eval()
        log["evals"] += 1
        with torch.no_grad():
            val = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in val_loader)
        log["val"].append((epoch, val, torch.rand(1).item()))  # the global RNG after the evaluation too
        sched.step()
        at(f"sched:{epoch}")

    try:
        if shape == "naive":  # no line for the epoch boundary at all
            for epoch in range(ckpt.progress.epoch, EPOCHS):
                one_epoch(epoch)
        elif shape == "epochs":
            with ckpt.guard(state) if guarded else contextlib.nullcontext():
                for epoch in ckpt.epochs(state, EPOCHS):
                    one_epoch(epoch)
        elif shape == "end_epoch":
            for epoch in range(ckpt.progress.epoch, EPOCHS):
                one_epoch(epoch)
                ckpt.end_epoch(state)
        else:  # "ignores progress": the negative control
            for epoch in range(EPOCHS):
                one_epoch(epoch)
    finally:
        ckpt.close()
    return {**{f"model.{k}": v.clone() for k, v in model.state_dict().items()},
            **{f"opt.{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()},
            "sched": torch.tensor([sched.last_epoch, *sched.get_last_lr()], dtype=torch.float64)}


def interrupted(run: Path, shape: str, stop: str, **kw) -> tuple[dict, dict]:
    log: dict = {"loss": {}, "val": [], "evals": 0}
    with pytest.raises((Killed, SystemExit, RuntimeError)) as err:
        train(run, shape, stop, log, **kw)
    if isinstance(err.value, SystemExit):
        assert err.value.code == EXIT_PREEMPTED
    return train(run, shape, None, log, **kw), log


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    log: dict = {"loss": {}, "val": [], "evals": 0}
    final = train(tmp_path_factory.mktemp("ref") / "run", "naive", None, log)
    assert log["evals"] == EPOCHS and sorted(log["loss"]) == list(range(1, EPOCHS * N // B + 1))
    return final, log


def same(reference: tuple[dict, dict], final: dict, log: dict) -> bool:
    want, want_log = reference
    want_vals = {e: (v, r) for e, v, r in want_log["val"]}
    return (final.keys() == want.keys() and all(torch.equal(final[k], want[k]) for k in want)
            and all(v == [want_log["loss"][s][0]] * len(v) for s, v in log["loss"].items())
            and {e for e, _, _ in log["val"]} == set(want_vals)  # every epoch evaluated; a re-run gives the same
            and all(want_vals[e] == (v, r) for e, v, r in log["val"]))


# stop points: inside an epoch, the last step of epoch 0 (saved there), the start of epoch 1's
# evaluation (saved at its last step), after epoch 1's scheduler.step() (the epoch-end work half done)
STOPS = ["step:4", "step:6", "eval:1", "sched:1"]


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("shape", ["naive", "epochs", "end_epoch"])
def test_an_epoch_loop_resumes_exactly_wherever_it_stopped(reference, tmp_path: Path, shape: str, stop: str) -> None:
    final, log = interrupted(tmp_path / "run", shape, stop)
    assert same(reference, final, log), (shape, stop)
    # only the process stopped after epoch 1's evaluation had run one that the resumed run ran again
    assert log["evals"] == EPOCHS + (stop == "sched:1")


def test_a_loop_that_ignores_the_progress_is_caught(reference, tmp_path: Path) -> None:
    """Negative control: the same comparison fails for a loop that starts again at epoch 0."""
    final, log = interrupted(tmp_path / "run", "ignores progress", "eval:1")
    assert not same(reference, final, log)


def test_a_preemption_during_the_evaluation_saves_at_the_end_of_the_epoch(reference, tmp_path: Path) -> None:
    run = tmp_path / "run"
    final, log = interrupted(run, "epochs", "signal:1")
    assert same(reference, final, log)
    assert log["evals"] == EPOCHS  # the evaluation of epoch 1 finished before the save: not run again
    kinds = {c.name: (c.kind, c.progress["epoch"]) for c in unbroken.Checkpointer(run, preemption=None).checkpoints()}
    # the last step of epoch 1 (step 12, inside the epoch) and the end of epoch 1 (the same step, epoch 2)
    assert ("regular", 1) in kinds.values() and ("preemption", 2) in kinds.values(), kinds


def test_an_exception_in_the_epoch_end_work_under_the_guard(reference, tmp_path: Path) -> None:
    """After epoch 0's scheduler.step() (its last step, 6, not saved: every 4 steps): the guard's
    emergency checkpoint is the state of that last step, scheduler before its step; the resumed
    run does epoch 0's end work again, once in the result."""
    run = tmp_path / "run"
    final, log = interrupted(run, "epochs", "sched:0", guarded=True, save_every=4)
    assert same(reference, final, log) and log["evals"] == EPOCHS + 1
    emergency = [(c.step, c.progress["epoch"]) for c in unbroken.Checkpointer(run, preemption=None).checkpoints()
                 if c.kind == "emergency"]
    assert emergency == [(6, 0)], emergency


def test_at_epoch_end_saves_after_the_epoch_end_work_even_at_a_saved_step(reference, tmp_path: Path) -> None:
    """Step 12 is saved by save_every (inside epoch 1) and again by AtEpochEnd (epoch 1 done):
    two instants of one step; the newest resumes into epoch 2 without running epoch 1's end again."""
    run = tmp_path / "run"
    final, log = interrupted(run, "epochs", "step:13", trigger=True)
    assert same(reference, final, log) and log["evals"] == EPOCHS
    at12 = sorted((c.progress["epoch"], c.name) for c in unbroken.Checkpointer(run, preemption=None).checkpoints()
                  if c.step == 12)
    assert [e for e, _ in at12] == [1, 2], at12


# ----------------------------------------------------------------------- the loader alone
def test_a_loader_restored_at_its_epochs_last_batch_ends_that_epoch_first() -> None:
    train_set, _ = data()
    make = lambda: unbroken.data.ResumableLoader(train_set, batch_size=B, shuffle=True, seed=2)  # noqa: E731
    loader = make()
    # strict=False: zip stops at the range, before it asks the loader for more (the loop not ended)
    served = [b for _, b in zip(range(N // B), loader, strict=False)]  # the last batch handed out
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, N) and len(served) == N // B
    # in this process, the loop broke out after the last batch: the next iterator is the next epoch
    again = next(iter(loader))[0]
    assert loader.epoch == 1 and torch.equal(again, next(iter(make_at(make, 1)))[0])
    # restored there (a checkpoint of the epoch's last step): the epoch's loop ends first, then epoch 1
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == [] and (resumed.epoch, resumed.position) == (1, 0)
    assert torch.equal(next(iter(resumed))[0], again)


def make_at(make, epoch: int):
    loader = make()
    loader.set_epoch(epoch)
    return loader


def test_set_epoch_keeps_the_position_inside_the_same_epoch() -> None:
    train_set, _ = data()
    loader = unbroken.data.ResumableLoader(train_set, batch_size=B, shuffle=True, seed=2)
    next(iter(loader))
    loader.set_epoch(0)
    assert (loader.epoch, loader.position) == (0, B)
    loader.set_epoch(3)
    assert (loader.epoch, loader.position) == (3, 0)
    with pytest.raises(ValueError):
        loader.set_epoch(-1)


# ------------------------------------------- a counted loop, by hand, with plain variables
def wlm(run: Path, stop: int | None = None, log: dict | None = None) -> dict:
    """word_language_model in miniature: a counted loop over a token tensor, SGD by hand, a hidden
    state carried across batches, the LR annealed when the validation loss does not improve."""
    torch.manual_seed(3)
    tokens = torch.randint(0, 11, (61, 2), generator=torch.Generator().manual_seed(4))
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(11, 6), "rnn": torch.nn.GRU(6, 6),
                                 "out": torch.nn.Linear(6, 11), "drop": torch.nn.Dropout(0.2)})
    loop = unbroken.Vars(lr=2.0, best_val_loss=None, hidden=None)
    state = {"model": model, "loop": loop}
    ckpt = unbroken.Checkpointer(run, save_every=4, keep_last=None, preemption=None)
    log = {"loss": {}, "lr": []} if log is None else log
    ckpt.restore(state)

    def forward(x, h):
        out, h = model["rnn"](model["drop"](model["emb"](x)), h)
        return F.log_softmax(model["out"](model["drop"](out)), -1), h

    try:
        for epoch in ckpt.epochs(state, range(1, 4)):
            model.train()
            hidden = loop.hidden if ckpt.progress.batch else torch.zeros(1, 2, 6)
            for _batch, i in ckpt.batches(enumerate(range(0, 60, 5))):
                x, y = tokens[i:i + 5], tokens[i + 1:i + 6]
                model.zero_grad()
                output, hidden = forward(x, hidden.detach())
                loss = F.nll_loss(output.view(-1, 11), y.reshape(-1))
                loss.backward()
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-loop.lr)
                loop.hidden = hidden.detach()
                ckpt.step(state, loss=loss)
                log["loss"].setdefault(ckpt.progress.step, []).append(loss.item())
                if ckpt.progress.step == stop:
                    raise Killed(stop)
            model.eval()
            with torch.no_grad():
                val_loss = F.nll_loss(forward(tokens[:60], None)[0].view(-1, 11), tokens[1:61].reshape(-1)).item()
            if not loop.best_val_loss or val_loss < loop.best_val_loss:
                loop.best_val_loss = val_loss
            else:
                loop.lr /= 4.0
            log["lr"].append((epoch, loop.lr))
    finally:
        ckpt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stop", [5, 12, 30])  # inside epoch 1, its last step, epoch 3's 6th step
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_counted_loop_with_plain_variables_resumes_exactly(tmp_path: Path, stop: int) -> None:
    ref_log: dict = {"loss": {}, "lr": []}
    want = wlm(tmp_path / "ref", None, ref_log)
    assert len(ref_log["loss"]) == 36 and len({lr for _, lr in ref_log["lr"]}) > 1  # the LR was annealed
    log: dict = {"loss": {}, "lr": []}
    with pytest.raises(Killed):
        wlm(tmp_path / "run", stop, log)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnbrokenWarning)  # no "model but no optimizer" warning
        got = wlm(tmp_path / "run", None, log)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(v == [ref_log["loss"][s][0]] * len(v) for s, v in log["loss"].items())
    assert dict(log["lr"]) == dict(ref_log["lr"])


def test_batches_refuses_a_dataloader_and_passes_a_resumable_loader_through(tmp_path: Path) -> None:
    ckpt = unbroken.Checkpointer(tmp_path / "run", preemption=None)
    with pytest.raises(TypeError, match="ResumableLoader"):
        ckpt.batches(DataLoader(data()[0], batch_size=4))
    loader = unbroken.data.ResumableLoader(data()[0], batch_size=B, shuffle=True, seed=2)
    assert len(list(ckpt.batches(loader))) == N // B and ckpt.progress.batch == 0
    with pytest.raises(TypeError):
        ckpt.epochs({}, 2.5)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ Vars and warnings
def test_vars_are_restored_in_place_and_new_names_keep_their_value(tmp_path: Path) -> None:
    loop = unbroken.Vars(lr=0.5, best=None, hidden=(torch.ones(2), torch.zeros(2)))
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        ckpt.restore({"loop": loop})
        loop.lr, loop.best, loop.hidden = 0.125, 1.5, (torch.full((2,), 3.0), torch.zeros(2))
        ckpt.save({"loop": loop})
    fresh = unbroken.Vars(lr=0.5, best=None, hidden=None, patience=3)  # patience: new in this version
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        ckpt.restore({"loop": fresh})
    assert (fresh.lr, fresh.best, fresh.patience) == (0.125, 1.5, 3)
    assert isinstance(fresh.hidden, tuple) and torch.equal(fresh.hidden[0], torch.full((2,), 3.0))


def forgotten(tmp_path: Path, by_hand: bool) -> list[str]:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # exists either way; steps only when not by hand
    with unbroken.Checkpointer(tmp_path / "run", save_every=2, preemption=None) as ckpt:
        ckpt.restore({"model": model})
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(2):
                model(torch.ones(3)).sum().backward()
                if by_hand:
                    for p in model.parameters():
                        p.data.add_(p.grad, alpha=-0.1)
                else:
                    opt.step()
                ckpt.step({"model": model})
    return [str(w.message) for w in record if issubclass(w.category, UnbrokenWarning)]


def test_no_optimizer_warning_for_a_loop_that_updates_by_hand(tmp_path: Path) -> None:
    assert not any("optimizer" in m for m in forgotten(tmp_path / "a", by_hand=True))
    found = forgotten(tmp_path / "b", by_hand=False)  # the optimizer that steps the model is not in the state
    assert any("not the SGD optimizer that steps its parameters" in m for m in found), found


def test_the_guard_writes_no_emergency_checkpoint_it_cannot_prove_for_updates_by_hand(tmp_path: Path) -> None:
    """Writes through ``p.data`` bump no version counter: after one, the guard took the updated
    parameters for the step's start, and the resume applied the update twice. With no optimizer in
    the state it writes none; the restart resumes from the last committed checkpoint."""
    model = torch.nn.Linear(2, 1)
    state = {"model": model}
    with unbroken.Checkpointer(tmp_path / "run", save_every=5, preemption=None) as ckpt:
        ckpt.restore(state)
        with pytest.raises(RuntimeError, match="after the update"), ckpt.guard(state):
            for step in range(3):
                model(torch.ones(2)).sum().backward()
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
                model.zero_grad()
                if step == 1:
                    raise RuntimeError("failed after the update")
                ckpt.step(state)
                at_start_of_step_2 = model.weight.detach().clone()
        for c in ckpt.checkpoints():  # whatever was written describes the instant it is labelled with
            assert c.step == 1 and torch.equal(unbroken.load(c.path)["model"]["weight"], at_start_of_step_2)
        assert ckpt.checkpoints() == []
