"""Golden checkpoints written by every format version load forever (see tests/golden/golden_state.py)."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import unbroken

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from golden_state import golden_state  # noqa: E402

VERSIONS = sorted(p for p in GOLDEN.glob("v*") if p.is_dir())


def test_there_is_a_golden_checkpoint_for_the_current_format() -> None:
    from unbroken.format.manifest import FORMAT_VERSION

    assert GOLDEN / f"v{FORMAT_VERSION}" in VERSIONS, \
        "new format version: run `python tests/golden/golden_state.py write` and commit the result"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("version", VERSIONS, ids=lambda p: p.name)
def test_golden_checkpoint_loads(version: Path, tmp_path: Path) -> None:
    ckpt_dir = version / "run" / "step-000000042"
    info = unbroken.verify(ckpt_dir)
    assert info.step == 42 and info.metrics == {"loss": 0.5}

    expected = golden_state()
    plain = unbroken.load(ckpt_dir)["plain"]
    for key, value in expected["plain"].items():
        assert _same(value, plain[key]), key

    run = tmp_path / "run"
    shutil.copytree(version / "run", run)
    live = golden_state()
    with torch.no_grad():
        live["model"].weight.zero_()
    live["generator"].manual_seed(0)
    live["plain"] = {}
    ck = unbroken.Checkpointer(run, signals=(), rng=False)
    assert ck.restore(live).step == 42
    assert torch.equal(live["model"].weight, expected["model"].weight)
    sd, exp_sd = live["optimizer"].state_dict(), expected["optimizer"].state_dict()
    assert all(torch.equal(sd["state"][0][k], exp_sd["state"][0][k]) for k in exp_sd["state"][0])
    assert sd["param_groups"] == exp_sd["param_groups"]
    assert torch.equal(live["generator"].get_state(), expected["generator"].get_state())
    ck.close()
