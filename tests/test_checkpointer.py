"""``unbroken.Checkpointer``: triggers, discovery, retention, restore, warnings, RNG and
a bitwise-exact resume of a full model + AdamW + LambdaLR + GradScaler state."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import unbroken
from unbroken.checkpointer.manager import UnbrokenWarning
from unbroken.store.local import _tag


def names(run) -> list[str]:
    return sorted(p.name for p in run.iterdir() if not p.name.startswith((".", "index.sqlite")))


def unbroken_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, UnbrokenWarning)]


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(8, 2))


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def first_weight(model) -> torch.Tensor:
    return next(model.parameters())


# ----------------------------------------------------------- basics & triggers

def test_fresh_start_returns_none(tmp_path):
    ckpt = unbroken.Checkpointer(tmp_path / "run")
    state = {"data": {"x": 1}}
    assert ckpt.restore(state) is None
    assert state == {"data": {"x": 1}}
    assert ckpt.progress.step == 0
    assert ckpt.latest() is None and ckpt.checkpoints() == []


def test_save_every_triggers_from_step(tmp_path):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, save_every=3, keep_last=None)
    state = {"data": {"v": 0}}
    infos = []
    for i in range(1, 8):
        state["data"]["v"] = i
        infos.append(ckpt.step(state))
    assert [i is not None for i in infos] == [False, False, True, False, False, True, False]
    assert infos[2].step == 3 and infos[5].step == 6
    assert names(run) == ["step-000000003", "step-000000006"]
    assert ckpt.progress.step == 7

    again = unbroken.Checkpointer(run)
    live = {"data": {"v": -1}}
    info = again.restore(live)
    assert info.step == 6 and info.name == "step-000000006"
    assert again.progress.step == 6
    assert live["data"]["v"] == 6


def test_progress_fields_restored(tmp_path):
    ckpt = unbroken.Checkpointer(tmp_path / "run", rng=False)
    ckpt.progress.epoch, ckpt.progress.samples = 3, 1234
    ckpt.step({"x": {"a": 1}})
    ckpt.save({"x": {"a": 1}})
    again = unbroken.Checkpointer(tmp_path / "run")
    again.restore({"x": {}})
    assert (again.progress.step, again.progress.epoch, again.progress.samples) == (1, 3, 1234)


# ------------------------------------------------------------------- retention

@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_last_keeps_exactly_the_newest(tmp_path, keep):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, save_every=1, keep_last=keep)
    for i in range(6):
        info = ckpt.step({"d": {"i": i}})
        assert info.name in names(run)  # the just-committed one is always there
    assert names(run) == [f"step-{s:09d}" for s in range(7 - keep, 7)]
    assert [c.step for c in ckpt.checkpoints()] == list(range(6, 6 - keep, -1))


def test_keep_last_none_keeps_all(tmp_path):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, save_every=1, keep_last=None)
    for i in range(5):
        ckpt.step({"d": {"i": i}})
    assert names(run) == [f"step-{s:09d}" for s in range(1, 6)]


def test_retention_never_deletes_the_just_committed(tmp_path, monkeypatch):
    monkeypatch.setenv("UNBROKEN_START_FRESH", "1")  # two writers that never restored, on purpose
    run = tmp_path / "run"
    a = unbroken.Checkpointer(run, keep_last=1, rng=False)
    a.progress.step = 1
    a.save({"d": {"who": "a1"}})
    # a second writer commits a checkpoint with a higher step in between
    b = unbroken.Checkpointer(run, keep_last=None, rng=False)
    b.progress.step = 10
    b.save({"d": {"who": "b"}})
    a.progress.step = 2
    info = a.save({"d": {"who": "a2"}})
    # whatever retention decided about the others, the one just saved must survive
    assert info.name in names(run)
    live = {"d": {}}
    unbroken.Checkpointer(run).restore(live, path=run / info.name)
    assert live["d"]["who"] == "a2"


def test_resume_from_older_path_makes_new_branch_newest(tmp_path):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, save_every=1, keep_last=None, rng=False)
    for i in range(1, 5):
        ckpt.step({"d": {"branch": "main", "i": i}})
    assert names(run) == [f"step-{s:09d}" for s in range(1, 5)]

    second = unbroken.Checkpointer(run, save_every=1, keep_last=None, rng=False)
    live = {"d": {}}
    info = second.restore(live, path=run / "step-000000002")
    assert info.step == 2 and second.progress.step == 2 and live["d"]["i"] == 2
    live["d"]["branch"] = "new"
    new = second.step(live)
    assert new.step == 3
    assert new.name == "step-000000003-2"  # collision with the old step 3
    assert (run / "step-000000003").is_dir()  # the old one is untouched
    latest = second.latest()
    assert latest.name == "step-000000003-2"
    assert latest.seq > max(c.seq for c in second.checkpoints() if c.name != latest.name)

    third = unbroken.Checkpointer(run, rng=False)
    live3 = {"d": {}}
    got = third.restore(live3)  # newest is the new branch, not the old step 4
    assert got.name == "step-000000003-2"
    assert live3["d"] == {"branch": "new", "i": 2}
    assert third.progress.step == 3


def test_resume_from_older_path_then_retention(tmp_path):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, save_every=1, keep_last=None, rng=False)
    for i in range(1, 5):
        ckpt.step({"d": {"i": i}})
    second = unbroken.Checkpointer(run, save_every=1, keep_last=2, rng=False)
    second.restore({"d": {}}, path=run / "step-000000001")
    second.step({"d": {"i": 20}})
    # the two most recently committed: old step 4 and the new step 2
    assert names(run) == ["step-000000002-2", "step-000000004"]


# ---------------------------------------------------------- restore(path=...)

def _corrupt_a_tensor_file(ckpt_dir):
    files = sorted(ckpt_dir.glob("*.safetensors"))
    assert files
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0x01
    files[0].write_bytes(raw)


def test_restore_invalid_path_raises_and_does_not_quarantine(tmp_path):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    model = tiny_model(0)
    ckpt.step({"w": model.state_dict()})
    info = ckpt.save({"w": model.state_dict()})
    bad = run / info.name
    _corrupt_a_tensor_file(bad)
    live_model = tiny_model(1)
    before = params_of(live_model)
    with pytest.raises(unbroken.CorruptCheckpointError):
        unbroken.Checkpointer(run).restore({"w": live_model.state_dict()}, path=bad)
    assert bad.is_dir()
    assert not (run / "quarantine").exists() or not any((run / "quarantine").iterdir())
    for k, v in params_of(live_model).items():
        assert torch.equal(v, before[k])


def test_restore_path_without_manifest_raises_corrupt(tmp_path):
    (tmp_path / "run" / "empty").mkdir(parents=True)
    with pytest.raises(unbroken.CorruptCheckpointError):
        unbroken.Checkpointer(tmp_path / "run").restore({"a": {}}, path=tmp_path / "run" / "empty")
    assert (tmp_path / "run" / "empty").is_dir()
    assert not (tmp_path / "run" / "quarantine").exists()


def test_restore_nonexistent_path_raises_no_checkpoint(tmp_path):
    ckpt = unbroken.Checkpointer(tmp_path / "run")
    with pytest.raises(unbroken.NoCheckpointError):
        ckpt.restore({"a": {}}, path=tmp_path / "run" / "step-000000042")
    with pytest.raises(FileNotFoundError):  # NoCheckpointError is also a FileNotFoundError
        ckpt.restore({"a": {}}, path=tmp_path / "nowhere")


# ------------------------------------------------------- stale staging cleanup

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_staging_of_dead_pid_removed_live_kept(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    host = _tag().split("_")[0]
    dead = _dead_pid()
    dead_staging = run / f".staging-{host}_{dead}_deadbeef_step-000000001"
    dead_trash = run / f".trash-{host}_{dead}_deadbeef_step-000000000"
    live_staging = run / f".staging-{host}_{os.getpid()}_cafef00d_step-000000002"
    other_host = run / f".staging-some-other-host_{dead}_0badc0de_step-000000003"
    for d in (dead_staging, dead_trash, live_staging, other_host):
        d.mkdir()
        (d / "t00-model.safetensors").write_bytes(b"partial")
    ckpt = unbroken.Checkpointer(run)
    assert dead_staging.exists(), "a Checkpointer that only exists must not touch the run"
    assert ckpt.restore({}) is None  # the writer starts: lock, then clean leftovers
    ckpt.close()

    assert not dead_staging.exists()
    assert not dead_trash.exists()
    assert live_staging.is_dir() and (live_staging / "t00-model.safetensors").exists()
    assert other_host.is_dir()  # may belong to a live writer elsewhere


def test_stale_staging_is_not_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    ckpt.step({"d": {"i": 1}})
    ckpt.save({"d": {"i": 1}})
    host = _tag().split("_")[0]
    (run / f".staging-{host}_{os.getpid()}_12345678_step-000000099").mkdir()
    assert [c.name for c in ckpt.checkpoints()] == ["step-000000001"]


# --------------------------------------------------------------------- warnings

def _save_and_collect(tmp_path, state, sub="run", **kw):
    ckpt = unbroken.Checkpointer(tmp_path / sub, keep_last=None, **kw)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ckpt.save(state)
    return ckpt, unbroken_warnings(rec)


def test_warns_model_without_optimizer_once(tmp_path):
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # steps the model, but is not in the state
    ckpt = unbroken.Checkpointer(tmp_path / "run", keep_last=None)
    ckpt.restore({"model": model})
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ckpt.save({"model": model})
    msgs = unbroken_warnings(rec)
    assert len(msgs) == 1 and "SGD optimizer" in msgs[0]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ckpt.save({"model": model})
    assert unbroken_warnings(rec) == []  # only at the first save


def test_warns_scheduler_missing(tmp_path):
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)  # adds 'initial_lr' to the param groups
    _, msgs = _save_and_collect(tmp_path, {"model": model, "optimizer": opt})
    assert len(msgs) == 1
    assert "scheduler" in msgs[0] and "optimizer" in msgs[0]


def test_no_warning_with_model_optimizer_scheduler(tmp_path):
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    _, msgs = _save_and_collect(tmp_path, {"model": model, "optimizer": opt, "scheduler": sched})
    assert msgs == []
    _, msgs = _save_and_collect(tmp_path, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=1)},
                                sub="run2")
    assert msgs == []  # no scheduler ever attached: nothing to warn about


def test_warns_micro_step_without_gradients(tmp_path):
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = unbroken.Checkpointer(tmp_path / "run", keep_last=None)
    ckpt.progress.micro_step = 2
    with pytest.warns(UnbrokenWarning, match="micro_step=2"):
        ckpt.save({"model": model, "optimizer": opt})
    ckpt2 = unbroken.Checkpointer(tmp_path / "run2", keep_last=None)
    ckpt2.progress.micro_step = 2
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ckpt2.save({"model": model, "optimizer": opt, "grads": unbroken.Gradients(model)})
    assert unbroken_warnings(rec) == []
    again = unbroken.Checkpointer(tmp_path / "run2")
    m = tiny_model(1)
    again.restore({"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1),
                   "grads": unbroken.Gradients(m)})
    assert again.progress.micro_step == 2


# ------------------------------------------------------------------- gradients

def test_gradients_roundtrip_exactly(tmp_path):
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(4, 2), "c": torch.nn.Linear(2, 2)})
    x = torch.randn(5, 3)
    model["b"](model["a"](x)).sum().backward()  # "c" keeps grad None
    model["a"].bias.grad = None
    saved = {k: (None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}
    assert any(v is None for v in saved.values()) and any(v is not None for v in saved.values())
    ckpt = unbroken.Checkpointer(tmp_path / "run", rng=False)
    ckpt.save({"grads": unbroken.Gradients(model)})

    live = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(4, 2), "c": torch.nn.Linear(2, 2)})
    for p in live.parameters():  # every grad present and wrong, shapes matching
        p.grad = torch.full_like(p, 7.0)
    live["b"].weight.grad = None  # and one missing where the checkpoint has one
    unbroken.Checkpointer(tmp_path / "run").restore({"grads": unbroken.Gradients(live)})
    for k, p in live.named_parameters():
        if saved[k] is None:
            assert p.grad is None, k
        else:
            assert p.grad is not None, k
            assert_bitwise(p.grad, saved[k], k)


# ------------------------------------------------------------------------- RNG

def test_rng_streams_continue_after_restore(tmp_path):
    run = tmp_path / "run"
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    torch.rand(3), random.random(), np.random.rand(2)  # advance a little
    ckpt = unbroken.Checkpointer(run)
    ckpt.save({"model": model, "optimizer": opt})
    expected = (torch.rand(6), [random.random() for _ in range(4)], np.random.rand(5), torch.randn(3))

    # wreck every global stream, then restore into fresh objects
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    fresh = tiny_model(5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    unbroken.Checkpointer(run).restore({"model": fresh, "optimizer": fresh_opt})
    got = (torch.rand(6), [random.random() for _ in range(4)], np.random.rand(5), torch.randn(3))
    assert torch.equal(got[0], expected[0])
    assert got[1] == expected[1]
    np.testing.assert_array_equal(got[2], expected[2])
    assert torch.equal(got[3], expected[3])


def test_rng_false_leaves_global_rng_alone(tmp_path):
    run = tmp_path / "run"
    unbroken.Checkpointer(run, rng=False).save({"d": {"a": 1}})
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    unbroken.Checkpointer(run, rng=False).restore({"d": {}})
    assert torch.equal(torch.rand(4), expected)


# ----------------------------------------------------- mismatch & reserved keys

@pytest.mark.filterwarnings("ignore::unbroken.checkpointer.manager.UnbrokenWarning")
def test_strict_key_mismatch_changes_nothing(tmp_path):
    run = tmp_path / "run"
    ckpt = unbroken.Checkpointer(run)
    ckpt.step({"model": tiny_model(0), "extra": {"a": 1}})
    ckpt.save({"model": tiny_model(0), "extra": {"a": 1}})

    live_model = tiny_model(1)
    before = params_of(live_model)
    again = unbroken.Checkpointer(run)
    torch.manual_seed(77)
    rng_before = torch.get_rng_state()
    with pytest.raises(unbroken.StateMismatchError, match="extra"):
        again.restore({"model": live_model})
    for k, v in params_of(live_model).items():
        assert torch.equal(v, before[k]), k
    assert again.progress.step == 0
    assert torch.equal(torch.get_rng_state(), rng_before)

    live_extra = {"x": 5}
    with pytest.raises(unbroken.StateMismatchError, match="other"):
        again.restore({"model": live_model, "extra": live_extra, "other": {"b": 2}})
    assert live_extra == {"x": 5}
    for k, v in params_of(live_model).items():
        assert torch.equal(v, before[k]), k


@pytest.mark.filterwarnings("ignore::unbroken.checkpointer.manager.UnbrokenWarning")
def test_non_strict_restores_common_keys(tmp_path):
    run = tmp_path / "run"
    src = tiny_model(0)
    ckpt = unbroken.Checkpointer(run)
    ckpt.step({"model": src, "extra": {"a": 1}})
    ckpt.save({"model": src, "extra": {"a": 1}})
    live_model = tiny_model(1)
    other = {"b": 2}
    loose = unbroken.Checkpointer(run, strict=False)
    assert loose.restore({"model": live_model, "other": other}) is not None
    for k, v in params_of(live_model).items():
        assert torch.equal(v, params_of(src)[k]), k
    assert other == {"b": 2}
    assert loose.progress.step == 1


def test_reserved_key_rejected(tmp_path):
    ckpt = unbroken.Checkpointer(tmp_path / "run")
    with pytest.raises(unbroken.UnbrokenError, match="__unbroken__"):
        ckpt.save({"__unbroken__": {"a": 1}})
    assert not (tmp_path / "run").exists() or names(tmp_path / "run") == []
    ckpt.save({"a": {"x": 1}})
    with pytest.raises(unbroken.UnbrokenError, match="__unbroken__"):
        ckpt.restore({"a": {}, "__unbroken__": 1})


# ------------------------------------------------------ full exact resume test

def _build(seed: int):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}


def _train_step(state, step: int) -> None:
    model, opt, sched, scaler = state["model"], state["optimizer"], state["scheduler"], state["scaler"]
    g = torch.Generator().manual_seed(1000 + step)  # data is a pure function of the step
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    model.train()
    loss = torch.nn.functional.mse_loss(model(x), y)  # dropout draws from the global RNG
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()


def _opt_tensors(opt):
    sd = opt.state_dict()
    return {(i, k): v.clone() for i, s in sd["state"].items() for k, v in s.items() if torch.is_tensor(v)}


def test_full_state_resumes_bitwise(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    state = _build(0)
    ckpt = unbroken.Checkpointer(run, save_every=5)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for step in range(5):
            _train_step(state, step)
            info = ckpt.step(state)
    assert unbroken_warnings(rec) == []
    assert info is not None and info.step == 5
    at_save = {
        "params": params_of(state["model"]),
        "opt": _opt_tensors(state["optimizer"]),
        "opt_groups": copy.deepcopy(state["optimizer"].state_dict()["param_groups"]),
        "sched": copy.deepcopy(state["scheduler"].state_dict()),
        "scaler": copy.deepcopy(state["scaler"].state_dict()),
    }
    assert at_save["scaler"]["scale"] != 2.0**8  # the scaler really moved
    for step in range(5, 9):
        _train_step(state, step)
    final_params = params_of(state["model"])
    final_opt = _opt_tensors(state["optimizer"])
    final_sched = state["scheduler"].state_dict()
    final_scaler = state["scaler"].state_dict()

    # "new process": fresh objects, different init, scrambled RNG
    torch.manual_seed(12345)
    fresh = _build(7)
    resumed = unbroken.Checkpointer(run, save_every=5)
    info = resumed.restore(fresh)
    assert info.step == 5 and resumed.progress.step == 5
    for k, v in at_save["params"].items():
        assert_bitwise(params_of(fresh["model"])[k], v, k)
    got_opt = _opt_tensors(fresh["optimizer"])
    assert set(got_opt) == set(at_save["opt"])
    for k, v in at_save["opt"].items():
        assert_bitwise(got_opt[k], v, str(k))
    assert fresh["optimizer"].state_dict()["param_groups"] == at_save["opt_groups"]
    assert fresh["scheduler"].state_dict() == at_save["sched"]
    assert fresh["scaler"].state_dict() == at_save["scaler"]
    # the live objects were restored in place, not replaced
    assert fresh["optimizer"].param_groups[0]["params"][0] is first_weight(fresh["model"])

    for step in range(5, 9):
        _train_step(fresh, step)
    for k, v in final_params.items():
        assert_bitwise(params_of(fresh["model"])[k], v, k)
    got_opt = _opt_tensors(fresh["optimizer"])
    for k, v in final_opt.items():
        assert_bitwise(got_opt[k], v, str(k))
    assert fresh["scheduler"].state_dict() == final_sched
    assert fresh["scaler"].state_dict() == final_scaler
