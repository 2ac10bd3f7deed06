"""``unbroken diff`` on real checkpoints: identical, different, mismatched, and errors."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sealing import load_doc, save_doc
from test_cli import as_json, flip_byte, invoke, train

import unbroken


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    train(tmp_path / "run", 4)
    return tmp_path / "run"


def test_a_checkpoint_and_its_copy_are_identical(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "step-000000004"
    shutil.copytree(run / "step-000000004", copy)
    res = invoke("diff", run / "step-000000004", copy, "--json")
    assert res.exit_code == 0, res.output
    doc = as_json(res)
    assert doc["identical"] is True and doc["identical_tensors"] > 0
    assert doc["tensors"] == doc["values"] == doc["manifest"] == doc["only_in_a"] == doc["only_in_b"] == []
    text = invoke("diff", run / "step-000000004", copy)
    assert text.exit_code == 0 and text.stdout.strip().endswith("identical")


def test_two_steps_differ(run: Path) -> None:
    a, b = run / "step-000000002", run / "step-000000004"
    res = invoke("diff", a, b, "--json")
    assert res.exit_code == 1, res.output
    doc = as_json(res)
    assert doc["identical"] is False
    wa, wb = (unbroken.load(p)["model"]["weight"].double() for p in (a, b))
    weight = next(t for t in doc["tensors"] if t["path"] == "model/weight")
    assert weight["problem"] == "" and weight["dtype"] == "float32" and weight["shape"] == [4, 8]
    assert weight["max_abs_diff"] == pytest.approx((wa - wb).abs().max().item())
    assert weight["rel_norm"] == pytest.approx(((wa - wb).norm() / wa.norm()).item())
    assert {"field": "step", "a": 2, "b": 4} in doc["manifest"]
    assert any(c["field"] == "metrics.loss" for c in doc["manifest"])
    assert {"path": "__unbroken__/progress/step", "a": 2, "b": 4} in doc["values"]
    text = invoke("diff", a, b)
    assert text.exit_code == 1 and "model/weight" in text.stdout and text.stdout.strip().endswith("differ")


def test_mismatches_and_one_sided_entries(tmp_path: Path) -> None:
    unbroken.save(tmp_path / "a", {"w": torch.zeros(3), "x": torch.zeros(2), "cfg": {"lr": 0.1, "name": "run"},
                                   "old": torch.ones(2), "steps": [1, 2]}, step=1)
    unbroken.save(tmp_path / "b", {"w": torch.zeros(4), "x": torch.zeros(2, dtype=torch.float64),
                                   "cfg": {"lr": 0.2, "name": "run"}, "new": 5, "steps": [1, 2, 3]}, step=1)
    res = invoke("diff", tmp_path / "a", tmp_path / "b", "--json")
    assert res.exit_code == 1, res.output
    doc = as_json(res)
    problems = {t["path"]: (t["problem"], t["other"]) for t in doc["tensors"]}
    assert problems == {"w": ("shape", [4]), "x": ("dtype", "float64")}
    assert doc["only_in_a"] == [{"path": "old", "what": "tensor float32 [2]"}]
    assert sorted(doc["only_in_b"], key=lambda e: e["path"]) == [{"path": "new", "what": "int"},
                                                               {"path": "steps/2", "what": "int"}]
    assert doc["values"] == [{"path": "cfg/lr", "a": 0.1, "b": 0.2}]
    assert doc["manifest"] == []


def test_nan_equals_nan_and_a_one_sided_nan_is_an_infinite_difference(tmp_path: Path) -> None:
    nan = float("nan")
    unbroken.save(tmp_path / "a", {"t": torch.tensor([1.0, nan, 3.0]), "u": torch.tensor([1.0, 2.0])})
    unbroken.save(tmp_path / "b", {"t": torch.tensor([1.0, nan, 3.5]), "u": torch.tensor([1.0, nan])})
    doc = as_json(invoke("diff", tmp_path / "a", tmp_path / "b", "--json"))
    found = {t["path"]: t for t in doc["tensors"]}
    assert found["t"]["max_abs_diff"] == 0.5
    assert found["u"]["max_abs_diff"] == "inf" and found["u"]["rel_norm"] == "inf"


def test_environment_changes_count_unless_informational(tmp_path: Path) -> None:
    train(tmp_path / "a", 2, env=unbroken.EnvCheck(config={"lr": 0.1}))
    train(tmp_path / "b", 2, env=unbroken.EnvCheck(config={"lr": 0.2}))
    a, b = tmp_path / "a" / "step-000000002", tmp_path / "b" / "step-000000002"
    res = invoke("diff", a, b, "--json")
    assert res.exit_code == 1, res.output
    doc = as_json(res)
    assert doc["tensors"] == [] and doc["values"] == [] and doc["manifest"] == []  # same training, other config
    assert {"field": "config.lr", "a": 0.1, "b": 0.2, "severity": "significant"} in doc["environment"]
    doc_b = load_doc(b)  # the same config, recorded on another host: informational only
    doc_b["environment"]["config"]["lr"] = 0.1
    doc_b["environment"]["host"] = "another-host"
    save_doc(b, doc_b)
    res = invoke("diff", a, b, "--json")
    assert res.exit_code == 0, res.output
    assert [c["field"] for c in as_json(res)["environment"]] == ["host"]
    assert "info, not counted" in invoke("diff", a, b).stdout


def test_errors_exit_2(run: Path, tmp_path: Path) -> None:
    res = invoke("diff", run / "step-000000004", tmp_path / "nothing")
    assert res.exit_code == 2 and "no checkpoint" in res.output
    flip_byte(run / "step-000000002" / "t00-model.safetensors")
    res = invoke("diff", run / "step-000000002", run / "step-000000004")
    assert res.exit_code == 2 and "checksum" in res.output


# ----------------------------------------------------------------- RNG streams
SCRIPT = """
import random, sys
import numpy as np
import torch
import unbroken

if sys.argv[2] == "draw":  # the unseeded global streams, drawn from: they then count
    np.random.rand()
    random.random()
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gens = {"torch": torch.Generator().manual_seed(1), "python": random.Random(2), "legacy": np.random.RandomState(3),
        "pcg": np.random.default_rng(4)}
state = {"model": model, "optimizer": opt, "generators": gens}
ckpt = unbroken.Checkpointer(sys.argv[1], save_every=2, preemption=None)
ckpt.restore(state, path=sys.argv[3]) if len(sys.argv) > 3 else ckpt.restore(state)
while ckpt.progress.step < 4:
    x = torch.randn(4, 8, generator=gens["torch"]) + gens["python"].random() + gens["legacy"].rand() + gens["pcg"].random()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt.step(state, loss=1.0)
ckpt.close()
"""  # noqa: E501 - the script's text, as it runs


def run_script(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """SCRIPT in this process (its global python and numpy generators are put back afterwards)."""
    saved = random.getstate(), np.random.get_state()
    with monkeypatch.context() as m:
        m.setattr(sys, "argv", ["train.py", *argv])
        try:
            exec(compile(SCRIPT, "train.py", "exec"), {"__name__": "__main__"})
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same script run three times: ``a`` and ``b`` exactly alike, each in its own process (the
    global python and numpy generators, never seeded, differ: OS entropy); ``c`` (here) also draws
    once from those two unseeded streams before training."""
    base = tmp_path_factory.mktemp("three")
    (base / "train.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, str(base / "train.py"), str(base / name), "plain"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for name in "ab"]  # at once
    with pytest.MonkeyPatch.context() as mp:
        run_script([str(base / "c"), "draw"], mp)
    for proc in runs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr.decode()[-2000:]
    return {name: base / name / "step-000000004" for name in "abc"}


def test_two_runs_of_the_same_script_are_identical(three_runs: dict[str, Path]) -> None:
    """Bitwise-equal training state is identical: generator objects compare by state (not by identity),
    and the global generators the script never seeded nor drew from are shown apart, not counted."""
    res = invoke("diff", three_runs["a"], three_runs["b"], "--json")
    assert res.exit_code == 0, res.output
    doc = as_json(res)
    assert doc["identical"] is True and doc["values"] == doc["tensors"] == doc["only_in_a"] == []
    assert doc["rng"] == [{"path": "(rank 0)/rng/python", "a": "never drawn", "b": "never drawn", "counted": False},
                          {"path": "(rank 0)/rng/numpy", "a": "never drawn", "b": "never drawn", "counted": False}]
    assert doc["identical_rng"] == 5  # 4 generator objects + the global torch generator
    text = invoke("diff", three_runs["a"], three_runs["b"]).stdout
    assert "rng streams: 5 identical, 0 differ, 2 never drawn from (not counted)" in text
    assert "rng (rank 0)/rng/numpy: differs (A: never drawn, B: never drawn)  (never drawn from: not counted)" in text
    assert text.strip().endswith("identical") and "/rng/python/1/" not in text  # one line per stream


def test_an_unseeded_stream_that_was_drawn_from_counts(three_runs: dict[str, Path]) -> None:
    res = invoke("diff", three_runs["a"], three_runs["c"], "--json")
    assert res.exit_code == 1, res.output
    doc = as_json(res)
    assert doc["values"] == doc["tensors"] == []  # the training state itself is the same
    assert doc["rng"] == [{"path": "(rank 0)/rng/python", "a": "never drawn", "b": "drawn", "counted": True},
                          {"path": "(rank 0)/rng/numpy", "a": "never drawn", "b": "drawn", "counted": True}]
    assert "rng (rank 0)/rng/python: differs (A: never drawn, B: drawn)" in invoke("diff", three_runs["a"],
                                                                                    three_runs["c"]).stdout


def test_a_checkpoint_and_its_resumed_resave_are_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 1-4, then a resume from step 2 that saves step 4 again: the same state, generator
    objects included (they used to differ: compared by identity)."""
    run = tmp_path / "run"
    run_script([str(run), "plain"], monkeypatch)
    run_script([str(run), "plain", str(run / "step-000000002")], monkeypatch)
    res = invoke("diff", run / "step-000000004", run / "step-000000004-2", "--json")
    assert res.exit_code == 0, res.output
    doc = as_json(res)
    assert doc["values"] == doc["rng"] == [] and doc["identical_rng"] == 7  # 4 objects + python, numpy, torch


def cuda_states(offset: int) -> list[torch.Tensor]:
    """One CUDA generator's state as torch writes it: the seed, then the Philox offset (int64 each)."""
    return [torch.tensor([67280421310721, offset], dtype=torch.int64).view(torch.uint8)]


@pytest.mark.parametrize(("offset", "counted"), [(0, False), (4, True)])
def test_cuda_states_on_one_side_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int,
                                      counted: bool) -> None:
    """A checkpoint saved on a GPU machine against one saved without CUDA: the CUDA stream is only in
    A; never drawn from there, it does not count; drawn from, it does."""
    from unbroken.state.rng import GlobalRNG

    plain = GlobalRNG.state_dict
    monkeypatch.setattr(GlobalRNG, "state_dict", lambda self: {**plain(self), "cuda": cuda_states(offset)})
    train(tmp_path / "gpu", 2)
    monkeypatch.setattr(GlobalRNG, "state_dict", plain)
    train(tmp_path / "cpu", 2)
    res = invoke("diff", tmp_path / "gpu" / "step-000000002", tmp_path / "cpu" / "step-000000002", "--json")
    assert res.exit_code == (1 if counted else 0), res.output
    state = "drawn" if counted else "never drawn"
    assert as_json(res)["rng"] == [{"path": "(rank 0)/rng/cuda", "a": state, "b": "absent", "counted": counted}]


def test_the_never_drawn_rule() -> None:
    from unbroken.cli.rngdiff import never_drawn

    fresh, seeded = random.Random(), random.Random(5)
    assert never_drawn("python", fresh.getstate()) and never_drawn("python", seeded.getstate())
    seeded.random()
    assert never_drawn("python", seeded.getstate()) is False
    gauss = random.Random(5)
    gauss.gauss(0, 1)
    assert never_drawn("python", gauss.getstate()) is False

    def np_state(rs: np.random.RandomState) -> dict:
        return rs.get_state(legacy=False)

    assert never_drawn("numpy", np_state(np.random.RandomState()))  # numpy's own OS-entropy seeding
    assert never_drawn("numpy", np_state(np.random.RandomState(7)))  # seeded with an integer
    for draw in (lambda r: r.rand(), lambda r: r.randint(10)):  # one 32-bit draw too
        for rs in (np.random.RandomState(), np.random.RandomState(7)):
            draw(rs)
            assert never_drawn("numpy", np_state(rs)) is False
    assert never_drawn("numpy", np_state(np.random.RandomState([1, 2]))) is False  # an array seed: cannot be told
    assert never_drawn("cuda", cuda_states(0)) and never_drawn("cuda", cuda_states(0) * 2)
    assert never_drawn("cuda", cuda_states(4)) is False
    assert never_drawn("cuda", cuda_states(0) + cuda_states(8)) is False
    assert never_drawn("torch", torch.get_rng_state()) is None  # torch's CPU generator starts from a fixed seed
