"""The Checkpointer records the environment and checks it on resume (warn / strict / ignore)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import unbroken


def _save(run: Path, **kw) -> None:
    with unbroken.Checkpointer(run, preemption=None, env=unbroken.EnvCheck(**kw)) as ckpt:
        ckpt.save({"w": torch.ones(2)})


def test_config_and_data_are_recorded(tmp_path: Path) -> None:
    _save(tmp_path / "run", config={"lr": 0.001, "layers": (2, 3)}, data="imagenet-v2")
    env = unbroken.verify(tmp_path / "run" / "step-000000000")
    manifest = (tmp_path / "run" / "step-000000000" / "manifest.json").read_text()
    assert '"lr": 0.001' in manifest and "imagenet-v2" in manifest and env.step == 0


def test_strict_refuses_a_changed_config_and_loads_nothing(tmp_path: Path) -> None:
    _save(tmp_path / "run", config={"lr": 0.001})
    w = torch.zeros(2)
    ckpt = unbroken.Checkpointer(tmp_path / "run", preemption=None,
                                 env=unbroken.EnvCheck(config={"lr": 0.002}, policy="strict"))
    with pytest.raises(unbroken.EnvironmentMismatchError, match=r"config\.lr.*0\.001.*0\.002"):
        ckpt.restore({"w": w})
    assert torch.equal(w, torch.zeros(2))
    ckpt.close()


def test_warn_logs_the_diff_and_restores(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path / "run", config={"lr": 0.001})
    w = torch.zeros(2)
    with unbroken.Checkpointer(tmp_path / "run", preemption=None, env=unbroken.EnvCheck(config={"lr": 0.002})) as ckpt:
        assert ckpt.restore({"w": w}) is not None
    assert torch.equal(w, torch.ones(2))
    assert any(r.levelno == logging.WARNING and "config.lr" in r.getMessage() for r in caplog.records)


def test_same_environment_is_silent_under_strict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path / "run", config={"lr": 0.001})
    caplog.set_level(logging.INFO, logger="unbroken")
    with unbroken.Checkpointer(tmp_path / "run", preemption=None,
                               env=unbroken.EnvCheck(config={"lr": 0.001}, policy="strict")) as c:
        assert c.restore({"w": torch.zeros(2)}) is not None
    assert not any("config" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_bad_policy_and_bad_config_fail_early() -> None:
    with pytest.raises(ValueError):
        unbroken.EnvCheck(policy="sometimes")
    with pytest.raises(TypeError, match="lambda|function"):
        unbroken.EnvCheck(config={"act": lambda v: v})
