"""Golden checkpoints written by every format version load forever (see tests/golden/golden_state.py).

Each ``tests/golden/v<N>`` holds a run with one checkpoint of format version N (v3: an
incremental run, whose ``chunks/`` folder is part of the fixture). The independent reader
(tools/unbroken_reader.py) is tested on the same fixtures in tests/test_reader_tool.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import xxhash

import unbroken
from unbroken.format.manifest import Manifest, is_chunk

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from golden_state import golden_state, tensor_bytes  # noqa: E402

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
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _expected(version: Path) -> dict:
    return json.loads((version / "expected.json").read_text())


def _check_tensors(part: str, actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys(), part
    for key, want in expected.items():
        assert actual[key] == want, f"{part}/{key}: bytes differ from the stored expectation"


@pytest.mark.parametrize("version", VERSIONS, ids=lambda p: p.name)
def test_golden_checkpoint_loads(version: Path, tmp_path: Path) -> None:
    """Every tensor is compared with the bytes stored beside the fixture (never recomputed:
    float math differs across CPUs); other leaves with the Python literals of golden_state()."""
    ckpt_dir = version / "run" / "step-000000042"
    expected = _expected(version)
    info = unbroken.verify(ckpt_dir)
    assert info.step == 42 and info.metrics == {"loss": 0.5}

    loaded = unbroken.load(ckpt_dir)
    _check_tensors("model", tensor_bytes(loaded["model"]), expected["model"])
    _check_tensors("optimizer", tensor_bytes(loaded["optimizer"]["state"]), expected["optimizer"])
    _check_tensors("generator", tensor_bytes(loaded["generator"].get_state()), expected["generator"])
    plain = loaded["plain"]
    literals = golden_state()["plain"]
    assert list(plain) == list(literals)
    _check_tensors("plain", tensor_bytes(plain), expected["plain"])
    for key, value in literals.items():
        if not isinstance(value, torch.Tensor):
            assert _same(value, plain[key]), key
        else:
            assert isinstance(plain[key], torch.Tensor) and plain[key].dtype == value.dtype, key

    run = tmp_path / "run"
    shutil.copytree(version / "run", run)
    live = golden_state()
    with torch.no_grad():
        live["model"].weight.zero_()
    live["generator"].manual_seed(0)
    live["plain"] = {}
    ck = unbroken.Checkpointer(run, preemption=None, rng=False)
    assert ck.restore(live).step == 42
    _check_tensors("model", tensor_bytes(live["model"].state_dict()), expected["model"])
    _check_tensors("optimizer", tensor_bytes(live["optimizer"].state_dict()["state"]), expected["optimizer"])
    assert live["optimizer"].state_dict()["param_groups"] == loaded["optimizer"]["param_groups"]
    assert live["optimizer"].state_dict()["param_groups"][0]["betas"] == (0.9, 0.95)
    _check_tensors("generator", tensor_bytes(live["generator"].get_state()), expected["generator"])
    ck.close()
    if (version / "run" / "chunks").is_dir():  # a writer opening the run collects no chunk in use
        assert sorted(os.listdir(run / "chunks")) == sorted(os.listdir(version / "run" / "chunks"))


@pytest.mark.parametrize("version", VERSIONS, ids=lambda p: p.name)
def test_golden_checkpoint_is_of_its_format_version(version: Path) -> None:
    """v<N> holds a checkpoint of format version N; from 3 on an incremental one: chunk maps
    instead of tensor files, and a chunks/ folder holding exactly the chunks the manifest
    lists, each named by the SHA-256 of its bytes, with the listed size and xxh3-128."""
    ckpt_dir = version / "run" / "step-000000042"
    manifest = Manifest.from_json((ckpt_dir / "manifest.json").read_bytes())
    assert manifest.format_version == int(version.name[1:])
    names = set(os.listdir(ckpt_dir))
    assert names == {f for f in manifest.files if not is_chunk(f)} | {"manifest.json"}
    if manifest.format_version < 3:
        assert not manifest.chunks and not (version / "run" / "chunks").exists()
        return
    assert not any(n.endswith(".safetensors") for n in names)
    maps = sorted(n for n in names if n.endswith(".chunks.json"))
    assert maps == ["t00-model.chunks.json", "t01-optimizer.chunks.json", "t02-plain.chunks.json",
                    "t03-generator.chunks.json"]
    stored = {p.name: p.read_bytes() for p in (version / "run" / "chunks").iterdir()}
    assert stored.keys() == manifest.chunks.keys()
    for cid, data in stored.items():
        entry = manifest.chunks[cid]
        assert hashlib.sha256(data).hexdigest() == cid
        assert len(data) == entry.size and xxhash.xxh3_128(data).hexdigest() == entry.xxh3_128
    used = [e["chunk"] for m in maps for e in json.loads((ckpt_dir / m).read_text())["tensors"].values()]
    assert set(used) == set(stored)
    assert len(used) > len(set(used)), "the fixture should hold a chunk used by two tensors (equal bytes)"
    assert hashlib.sha256(b"").hexdigest() in stored  # the empty tensor: a chunk of 0 bytes


@pytest.mark.parametrize("version", [v for v in VERSIONS if (v / "run" / "chunks").is_dir()],
                         ids=lambda p: p.name)
def test_incremental_save_after_restoring_a_golden_checkpoint(version: Path, tmp_path: Path) -> None:
    """Restored from the fixture, an incremental save of the unchanged state writes no new
    chunk: it references every chunk of the fixture (the restored checkpoint is its base)."""
    run = tmp_path / "run"
    shutil.copytree(version / "run", run)
    live = golden_state()
    ck = unbroken.Checkpointer(run, preemption=None, rng=False, incremental=True, keep_last=None)
    assert ck.restore(live).step == 42
    ck.save(live)
    stats = ck.run.chunks.last
    ck.close()
    assert stats.written == 0 and stats.reused > 0
    old = Manifest.from_json((version / "run" / "step-000000042" / "manifest.json").read_bytes())
    new = Manifest.from_json((Path(ck.last_saved.path) / "manifest.json").read_bytes())
    assert new.chunks == old.chunks
    loaded = unbroken.load(ck.last_saved.path)
    expected = _expected(version)
    _check_tensors("model", tensor_bytes(loaded["model"]), expected["model"])
    _check_tensors("plain", tensor_bytes(loaded["plain"]), expected["plain"])


def test_golden_expectations_are_not_recomputed() -> None:
    """The negative control: a changed byte in a stored expectation is caught."""
    version = VERSIONS[-1]
    expected = _expected(version)
    key = next(iter(expected["model"]))
    h = expected["model"][key]["hex"]
    expected["model"][key]["hex"] = ("0" if h[0] != "0" else "1") + h[1:]
    loaded = unbroken.load(version / "run" / "step-000000042")
    with pytest.raises(AssertionError):
        _check_tensors("model", tensor_bytes(loaded["model"]), expected["model"])
