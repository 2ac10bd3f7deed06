"""``unbroken diff`` on real checkpoints: identical, different, mismatched, and errors."""

from __future__ import annotations

import shutil
from pathlib import Path

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
