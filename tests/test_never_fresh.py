"""Never restart from step 0 when the run has progress, and never leave a half-restored state.

- incremental runs: a damaged or missing chunk that every checkpoint shares (a frozen layer) is
  rewritten from the live state when it holds the same bytes, and the newest checkpoint restores;
  a chunk nothing can repair makes only the checkpoints that use it invalid, and when that is all
  of them the restore raises instead of training from step 0;
- a remote tier that cannot be listed while the local tier has nothing: refused, not a fresh start;
- a real training process whose every checkpoint is damaged exits with the error, not at step 0;
- a restore refused by one part (an optimizer over other parameters, a user object whose
  ``load_state_dict`` raises) leaves every part of the state as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.run.index.index import RunIndex
from unbroken.checkpoint.chunks import chunk_id
from unbroken.checkpoint.reader import read_manifest
from unbroken.store import open_store

from test_incremental import ckpt, flat, make, same, train


def chunk_path(run: Path, tensor: torch.Tensor) -> Path:
    return run / "chunks" / chunk_id(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def saved_run(run: Path, steps: int = 3) -> dict:
    """An incremental run of ``steps`` saves whose frozen base is shared by every checkpoint."""
    state = make()
    c = ckpt(run)
    c.restore(state)
    for _ in range(steps):
        train(state)
        c.step(state)
    c.close()
    return state


def users_of(run: Path, chunk: Path) -> list[str]:
    store = open_store(run)
    return sorted(n for n in store.list_committed() if chunk.name in read_manifest(store, n).chunks)


@pytest.mark.parametrize("damage", ["flipped", "deleted", "truncated"])
def test_a_damaged_shared_chunk_is_rewritten_from_the_live_state(tmp_path: Path, damage: str) -> None:
    run = tmp_path / "run"
    state = saved_run(run)
    shared = chunk_path(run, state["model"].base.weight)
    assert users_of(run, shared) == ["step-000000001", "step-000000002", "step-000000003"]
    good = shared.read_bytes()
    if damage == "flipped":
        raw = bytearray(good)
        raw[100] ^= 0x10
        shared.write_bytes(bytes(raw))
    elif damage == "deleted":
        shared.unlink()
    else:
        shared.write_bytes(good[:-7])

    fresh = make(seed=0)  # the frozen base loaded again: the same bytes as the damaged chunk
    fresh["model"].a.data.zero_()  # the adapter is not (it comes from the checkpoint)
    c = ckpt(run)
    info = c.restore(fresh)
    assert info is not None and info.step == 3  # the newest, not a fallback, not a fresh start
    assert same(flat(fresh), flat(state))
    assert c.run.store.list_committed() == ["step-000000001", "step-000000002", "step-000000003"]
    c.close()
    assert shared.read_bytes() == good  # rewritten, verified
    if damage != "deleted":  # the damaged bytes are kept for inspection
        assert (run / "quarantine" / "chunks" / shared.name).is_file()
    assert not any((run / "quarantine").glob("step-*"))
    for name in users_of(run, shared):
        unbroken.verify(run / name)


def test_an_unrepairable_chunk_invalidates_only_its_users_then_raises(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = saved_run(run, steps=2)
    adapter = chunk_path(run, state["model"].a)  # changes every step: only the newest uses it
    assert users_of(run, adapter) == ["step-000000002"]
    adapter.unlink()
    fresh = make(seed=5)
    c = ckpt(run)
    info = c.restore(fresh)  # the live adapter differs: not repairable, so the older one is used
    assert info is not None and info.step == 1
    c.close()
    assert (run / "quarantine" / "step-000000002").is_dir()

    base = chunk_path(run, state["model"].base.weight)  # used by every checkpoint left
    raw = bytearray(base.read_bytes())
    raw[0] ^= 0xFF
    base.write_bytes(bytes(raw))
    other = make(seed=9)  # another base: nothing holds the bytes
    before = flat(other)
    c = ckpt(run)
    with pytest.raises(unbroken.NoValidCheckpointError, match="(?s)step-000000001.*step-000000002"):
        c.restore(other)
    assert same(flat(other), before) and c.progress.step == 0
    c.close()


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_an_unreachable_remote_with_an_empty_local_tier_is_not_a_fresh_start(tmp_path: Path, s3, s3_url) -> None:
    remote = lambda: unbroken.Remote(s3_url, storage_options=s3.storage_options, retry_wait_s=0.5,  # noqa: E731
                                     retry_max_wait_s=1.0, close_timeout_s=60,
                                     request_deadline_s=5)
    state = make()
    c = unbroken.Checkpointer(tmp_path / "node1", save_every=1, remote=remote(), preemption=None)
    c.restore(state)
    train(state)
    c.step(state)
    assert c.wait(timeout=60)
    c.close()
    s3.kill()  # a new node (empty local folder) while the remote tier is down
    try:
        fresh = make(seed=3)
        before = flat(fresh)
        c = unbroken.Checkpointer(tmp_path / "node2", save_every=1, remote=remote(), preemption=None)
        with pytest.raises(unbroken.NoValidCheckpointError, match="remote tier could not be listed"):
            c.restore(fresh)
        assert same(flat(fresh), before)
        c.close()
    finally:
        s3.start()
    c = unbroken.Checkpointer(tmp_path / "node2", save_every=1, remote=remote(), preemption=None)
    assert c.restore(fresh).step == 1  # back: downloaded from the remote tier
    assert same(flat(fresh), flat(state))
    c.close()


SCRIPT = """
import sys, torch, unbroken
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optimizer": opt}
ckpt = unbroken.Checkpointer(sys.argv[1], save_every=2, keep_last=None)
ckpt.restore(state)
print("start", ckpt.progress.step, flush=True)
while ckpt.progress.step < 6:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.step(state)
ckpt.close()
"""


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_training_process_whose_checkpoints_are_all_damaged_exits_instead_of_restarting(tmp_path: Path) -> None:
    run, script = tmp_path / "run", tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_START_FRESH"}
    first = subprocess.run([sys.executable, str(script), str(run)], capture_output=True, text=True, env=env,
                           timeout=300)
    assert first.returncode == 0 and "start 0" in first.stdout
    for folder in sorted(run.glob("step-*")):
        tensors = sorted(folder.glob("*.safetensors"))
        raw = bytearray(tensors[0].read_bytes())
        raw[-1] ^= 0x01
        tensors[0].write_bytes(bytes(raw))
    for _ in range(2):  # the relaunch too: the damaged checkpoints are in quarantine/ by then
        again = subprocess.run([sys.executable, str(script), str(run)], capture_output=True, text=True, env=env,
                               timeout=300)
        assert again.returncode == 1 and "start" not in again.stdout
        assert "NoValidCheckpointError" in again.stderr and "step-000000006" in again.stderr
    on_purpose = subprocess.run([sys.executable, str(script), str(run)], capture_output=True, text=True,
                                env={**env, "UNBROKEN_START_FRESH": "1"}, timeout=300)
    assert on_purpose.returncode == 0 and "start 0" in on_purpose.stdout
    assert sorted(p.name for p in (run / "quarantine").iterdir() if p.is_dir()) == \
        ["step-000000002", "step-000000004", "step-000000006"]


class Refuses:
    """A user object whose load_state_dict refuses what was saved."""

    def __init__(self) -> None:
        self.value = 1

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]  # changed before it refuses: must be put back
        if self.value != 1:
            raise ValueError("no")


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def small_state(lr: float = 0.1, groups: int = 1) -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    params = [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}] \
        if groups == 2 else [{"params": list(model.parameters())}]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return {"counter": Counter(), "model": model, "optimizer": opt, "scheduler": sched}


def snapshot(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "opt": repr(state["optimizer"].state_dict()), "sched": repr(state["scheduler"].state_dict()),
            "counter": state["counter"].n}


def saved(tmp_path: Path, **kw) -> Path:
    state = small_state(**kw)
    state["model"](torch.randn(2, 3)).sum().backward()
    state["optimizer"].step()
    state["scheduler"].step()
    state["counter"].n = 7
    c = unbroken.Checkpointer(tmp_path / "run", preemption=None)
    c.save(state)
    c.close()
    return tmp_path / "run"


@pytest.mark.parametrize("how", ["checkpointer", "load"])
def test_an_optimizer_over_other_parameters_is_refused_before_anything_is_loaded(tmp_path: Path, how: str) -> None:
    run = saved(tmp_path, groups=2)
    live = small_state(lr=0.5, groups=1)  # one group where two were saved: torch would refuse half-way
    before = snapshot(live)
    with pytest.raises(unbroken.StateMismatchError, match="parameter groups"):
        if how == "checkpointer":
            c = unbroken.Checkpointer(run, preemption=None)
            try:
                c.restore(live)
            finally:
                c.close()
        else:
            unbroken.load(run, live)
    after = snapshot(live)
    assert after["counter"] == before["counter"] and after["opt"] == before["opt"] and after["sched"] == before["sched"]
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])


def test_a_user_object_that_refuses_leaves_every_part_as_it_was(tmp_path: Path) -> None:
    run = saved(tmp_path)
    live = small_state(lr=0.5)
    before = snapshot(live)
    c = unbroken.Checkpointer(run, preemption=None, strict=False)
    newer = {**small_state(), "refuses": Refuses()}
    newer["refuses"].value = 5
    c.start_fresh()  # this process writes a newer checkpoint on purpose, without resuming
    c.save(newer)  # a newer checkpoint, with a value the object refuses
    live["refuses"] = Refuses()
    with pytest.raises(unbroken.StateMismatchError, match="refuses.*load_state_dict"):
        c.restore(live)
    c.close()
    after = snapshot(live)
    assert live["refuses"].value == 1  # put back
    assert after["counter"] == before["counter"] and after["opt"] == before["opt"] and after["sched"] == before["sched"]
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])


@pytest.mark.slow
def test_every_rank_refuses_when_every_checkpoint_is_damaged(tmp_path: Path) -> None:
    """torchrun, 2 ranks (DDP): every checkpoint damaged → every rank raises the same error (the
    choice of a checkpoint is collective), no rank starts at step 0, the relaunch too."""
    from test_distributed import job, run, torchrun

    code, out = run(torchrun(2, *job(tmp_path, "--stop-at", "8")))
    assert code == 0, out
    folders = sorted((tmp_path / "run").glob("step-*"))
    assert len(folders) == 2
    for folder in folders:
        raw = bytearray((folder / "state.json").read_bytes())
        raw[len(raw) // 2] ^= 0x01
        (folder / "state.json").write_bytes(bytes(raw))
    for _ in range(2):
        code, out = run(torchrun(2, *job(tmp_path)))
        assert code != 0
        assert "fresh start" not in out and "resumed from" not in out
        assert out.count("NoValidCheckpointError") >= 2, out  # both ranks
        assert "step-000000004" in out and "step-000000008" in out


# ------------------------------------------- a relaunch that never called restore() (issue 33 §4)
def _linear() -> dict:
    torch.manual_seed(0)
    return {"w": torch.nn.Linear(4, 4, bias=False)}


def _committed(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))


def test_a_relaunch_that_forgot_restore_is_refused_before_anything_is_written_or_deleted(tmp_path: Path) -> None:
    """A script that does not call ``restore()`` on a run with checkpoints (a forgotten call, an ``if
    args.resume:`` without the flag) would start at step 0 under newer sequence numbers, and retention
    (keep_last=2) would delete the run's real checkpoints: refused at its first save, naming the way."""
    run = tmp_path / "run"
    with unbroken.Checkpointer(run, save_every=2, keep_last=2) as c:
        state = _linear()
        c.restore(state)
        for _ in range(6):
            c.step(state)
    before = {p.name: (p / "manifest.json").read_bytes() for p in run.iterdir() if p.name.startswith("step-")}
    assert sorted(before) == ["step-000000004", "step-000000006"]
    with unbroken.Checkpointer(run, save_every=2, keep_last=2) as c:  # the relaunch, no restore()
        state = _linear()
        c.step(state)
        with pytest.raises(unbroken.errors.ConfigurationError,
                           match=r"already has 2 checkpoint\(s\), the newest at step 6.*without having called "
                                 r"restore\(\).*ckpt\.restore\(state\).*UNBROKEN_START_FRESH=1"):
            c.step(state)  # step 2 is due
        with pytest.raises(unbroken.errors.ConfigurationError, match="without having called restore"):
            c.save(state)  # every save, not only the scheduled ones
    after = {p.name: (p / "manifest.json").read_bytes() for p in run.iterdir() if p.name.startswith("step-")}
    assert after == before  # nothing written, nothing deleted


def test_starting_over_on_purpose_and_a_new_run_need_no_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    with unbroken.Checkpointer(run, save_every=1) as c:  # a new run: nothing to resume, no restore() needed
        state = _linear()
        c.step(state)
    assert _committed(run) == ["step-000000001"]
    monkeypatch.setenv("UNBROKEN_START_FRESH", "1")
    with unbroken.Checkpointer(run, save_every=1, keep_last=1) as c:
        c.step(_linear())
    assert "starts over without restoring" in caplog.text
    assert len(_committed(run)) == 1  # the old one replaced as retention went on: asked for
    with RunIndex(run, readonly=True) as index:  # recorded, not only a log line
        [event] = index.events("started_over")
    assert event["step"] == 1 and event["data"] == {"checkpoints": 1, "newest_step": 1}
    assert event["message"] == "UNBROKEN_START_FRESH=1", event
    monkeypatch.delenv("UNBROKEN_START_FRESH")
    with unbroken.Checkpointer(run, save_every=1, keep_last=1) as c:  # in the script: start_fresh()
        c.start_fresh()
        c.step(_linear())
    with RunIndex(run, readonly=True) as index:
        events = index.events("started_over")
    assert len(events) == 2 and events[1]["step"] == 0 and events[1]["message"] == "start_fresh()", events


def test_checkpoints_that_vanished_while_the_index_remembers_them_are_not_a_fresh_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every checkpoint folder deleted (by hand, a storage that lost them) while the run index remembers
    them committed: ``restore()`` raises naming each, not an INFO line and step 0. A fresh start on
    purpose is recorded, so a relaunch does not ask again; a later checkpoint of the same name that
    vanishes asks again (it is named with its sequence number)."""
    run = tmp_path / "run"
    with unbroken.Checkpointer(run, save_every=2) as c:
        state = _linear()
        c.restore(state)
        for _ in range(4):
            c.step(state)
    for name in _committed(run):
        shutil.rmtree(run / name)
    with unbroken.Checkpointer(run) as c:
        with pytest.raises(unbroken.NoValidCheckpointError,
                           match=r"(?s)step-000000004 \(seq \d+, created [^)]+\): committed at step 4"
                                 r".*step-000000002 \(seq "):
            c.restore(_linear())
    monkeypatch.setenv("UNBROKEN_START_FRESH", "1")
    with unbroken.Checkpointer(run, save_every=2) as c:
        state = _linear()
        assert c.restore(state) is None  # on purpose: recorded
        c.step(state)
        c.step(state)  # a new step-000000002
    monkeypatch.delenv("UNBROKEN_START_FRESH")
    assert _committed(run) == ["step-000000002"]
    with unbroken.Checkpointer(run) as c:
        assert c.restore(_linear()).step == 2  # the new one; the vanished ones do not ask again
    shutil.rmtree(run / "step-000000002")
    with unbroken.Checkpointer(run) as c:  # the new step 2 vanished too: asked again, for it alone
        with pytest.raises(unbroken.NoValidCheckpointError, match="step-000000002") as raised:
            c.restore(_linear())
    assert "step-000000004" not in str(raised.value)
