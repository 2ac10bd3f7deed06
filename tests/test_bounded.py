"""Bounded reading of checkpoints that pass their checksums but were written by an adversary
(the manifest re-sealed, every file re-listed with its true size and checksum): a tensor file
of 1.5 million empty tensors, a header that claims more bytes than the file, absurd RNG and
progress values, a listed file bigger than the machine's memory. Each is refused with a
library error, never a crash, a hang or an out-of-memory kill; a refused checkpoint is
quarantined and the restore falls back to the previous one, and a semantically bad state
(RNG, counters) fails the restore before anything in the live state has changed.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sealing import load_doc, save_doc

import unbroken
from unbroken import CorruptCheckpointError
from unbroken.errors import StorageError
from unbroken.format.manifest import new_hasher
from unbroken.format.tensorfile import MAX_TENSORS
from unbroken.store import readfile as local_store


def build(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}


def train(run: Path, steps: int) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps saving every 2; the weights after each saved step."""
    state = build()
    saved = {}
    with unbroken.Checkpointer(run, save_every=2, keep_last=None, preemption=None) as ckpt:
        ckpt.restore(state)
        for _ in range(steps):
            loss = state["model"](torch.randn(4, 6)).pow(2).mean()
            loss.backward()
            state["optimizer"].step()
            state["optimizer"].zero_grad()
            if ckpt.step(state):
                saved[ckpt.progress.step] = {k: v.clone() for k, v in state["model"].state_dict().items()}
    return saved


@pytest.fixture()
def run(tmp_path: Path) -> tuple[Path, dict]:
    run = tmp_path / "run"
    return run, train(run, 4)


def relist(ckpt: Path, fname: str, raw: bytes) -> None:
    """Replace ``fname`` with ``raw`` and list its true size and checksum in a re-sealed manifest."""
    (ckpt / fname).write_bytes(raw)
    h = new_hasher()
    h.update(raw)
    doc = load_doc(ckpt)
    doc["files"][fname] = {"size": len(raw), "xxh3_128": h.hexdigest()}
    save_doc(ckpt, doc)


def model_file(ckpt: Path) -> str:
    return next(p.name for p in ckpt.iterdir() if p.name.endswith("-model.safetensors"))


def restore_falls_back(run: Path, saved: dict) -> None:
    """The damaged step-4 checkpoint is quarantined; the restore loads step 2 exactly."""
    state = build(seed=99)
    with unbroken.Checkpointer(run, preemption=None) as ckpt:
        info = ckpt.restore(state)
    assert info is not None and info.step == 2
    assert all(torch.equal(v, saved[2][k]) for k, v in state["model"].state_dict().items())
    assert (run / "quarantine").is_dir() and any((run / "quarantine").iterdir())


def test_a_header_of_a_million_and_a_half_empty_tensors_is_refused(run: tuple[Path, dict]) -> None:
    """A valid safetensors file (empty tensors need no data) whose header took a minute and
    gigabytes to parse before the tensor count was bounded."""
    path, saved = run
    ckpt = path / "step-000000004"
    n = MAX_TENSORS * 3 // 2
    header = "{" + ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(n)) + "}"
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    relist(ckpt, model_file(ckpt), struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptCheckpointError, match="tensors"):
        unbroken.verify(ckpt)
    restore_falls_back(path, saved)


def test_a_header_that_claims_more_bytes_than_the_file_is_refused(run: tuple[Path, dict]) -> None:
    path, saved = run
    ckpt = path / "step-000000004"
    fname = model_file(ckpt)
    raw = bytearray((ckpt / fname).read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) * 10)
    relist(ckpt, fname, bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="header claims"):
        unbroken.verify(ckpt)
    restore_falls_back(path, saved)


def _find(node: Any, key: str) -> Any:
    """The first ``{"@": "dict", "v": {...}}`` mapping that holds ``key``, anywhere in ``node``."""
    if isinstance(node, dict):
        if isinstance(node.get("v"), dict) and key in node["v"]:
            return node["v"]
        for v in node.values():
            found = _find(v, key)
            if found is not None:
                return found
    elif isinstance(node, list):
        for v in node:
            found = _find(v, key)
            if found is not None:
                return found
    return None


def edit_json(ckpt: Path, fname: str, key: str, edit: Any) -> None:
    doc = json.loads((ckpt / fname).read_text())
    holder = _find(doc, key)
    assert holder is not None, (fname, key)
    before = json.dumps(doc)
    edit(holder)
    assert json.dumps(doc) != before
    relist(ckpt, fname, json.dumps(doc).encode())


def _python_word(h: dict) -> None:
    h["python"]["v"][1]["v"][5] = 2**40  # an internal state word out of 32 bits


def _python_index(h: dict) -> None:
    h["python"]["v"][1]["v"][-1] = 10**6  # the position past the 624 words


def _torch_state(h: dict) -> None:
    h["torch"] = {"@": "int", "hex": "ff"}


def _missing_numpy(h: dict) -> None:
    del h["numpy"]


def _step_huge(h: dict) -> None:
    h["progress"]["v"]["step"] = 2**70


def _step_negative(h: dict) -> None:
    h["progress"]["v"]["step"] = -3


def _samples_float(h: dict) -> None:
    h["progress"]["v"]["samples"] = 1.5


BAD_STATES = {
    "python RNG word over 32 bits": ("rank-00000.json", "python", _python_word),
    "python RNG position past the state": ("rank-00000.json", "python", _python_index),
    "torch RNG state not a tensor": ("rank-00000.json", "python", _torch_state),
    "numpy RNG state missing": ("rank-00000.json", "python", _missing_numpy),
    "step of 70 bits": ("state.json", "progress", _step_huge),
    "negative step": ("state.json", "progress", _step_negative),
    "fractional sample count": ("state.json", "progress", _samples_float),
}


@pytest.mark.parametrize("case", BAD_STATES)
def test_absurd_rng_and_progress_values_fail_the_restore_before_anything_changes(
        run: tuple[Path, dict], case: str) -> None:
    path, _ = run
    fname, key, edit = BAD_STATES[case]
    edit_json(path / "step-000000004", fname, key, edit)
    state = build(seed=7)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    rng_before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with unbroken.Checkpointer(path, preemption=None) as ckpt:
        with pytest.raises(CorruptCheckpointError):
            ckpt.restore(state)
        assert ckpt.progress.step == 0
    assert all(torch.equal(v, before[k]) for k, v in state["model"].state_dict().items())
    assert not state["optimizer"].state  # the AdamW moments were not loaded either
    assert random.getstate() == rng_before[0]
    assert np.array_equal(np.random.get_state()[1], rng_before[1])
    assert torch.equal(torch.get_rng_state(), rng_before[2])


def sparse_8gib_file(path: Path) -> tuple[Path, str]:
    """Checkpoint step 4 with its model file grown (sparse) to 8 GiB and listed with that size."""
    ckpt = path / "step-000000004"
    fname = model_file(ckpt)
    with open(ckpt / fname, "r+b") as f:
        f.truncate(8 * 2**30)
    doc = load_doc(ckpt)
    doc["files"][fname]["size"] = 8 * 2**30
    save_doc(ckpt, doc)
    return ckpt, fname


def test_a_listed_file_bigger_than_the_memory_is_refused_before_allocating(
        run: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse 8 GiB file listed with its true size: reading it whole would be killed by the
    OOM killer on a small machine (Linux overcommits, so the allocation alone succeeds). With
    less memory available than the file, the read is refused with a StorageError naming both.
    (Local files this large are mapped, not read into memory: this is the path of remote
    stores and of ``UNBROKEN_NO_MMAP=1``.)"""
    monkeypatch.setenv("UNBROKEN_NO_MMAP", "1")
    path, _ = run
    ckpt, fname = sparse_8gib_file(path)
    monkeypatch.setattr(local_store, "available_memory", lambda: 4 * 2**30)  # a 4 GiB machine
    with pytest.raises(StorageError, match=r"8\.0 GiB.*4\.0 GiB"):
        unbroken.verify(ckpt)
    state = build(seed=7)
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with unbroken.Checkpointer(path, preemption=None) as c:
        with pytest.raises(StorageError, match="memory available"):
            c.restore(state)
    assert all(torch.equal(v, before[k]) for k, v in state["model"].state_dict().items())
    assert (ckpt / fname).exists()  # not quarantined: it may be a real checkpoint on a small machine


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_large_local_file_is_mapped_and_checked_without_allocating_it(
        run: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same 8 GiB sparse file on a "4 GiB machine", read the default way: it is mapped
    (no allocation, so no refusal), every byte is hashed, and the checksum finds it altered."""
    path, _ = run
    ckpt, fname = sparse_8gib_file(path)

    real = local_store.allocate

    def small_only(size: int, file: str) -> Any:
        assert size < 2**30, f"allocated {size} bytes for {file}"
        return real(size, file)

    monkeypatch.setattr(local_store, "allocate", small_only)
    with pytest.raises(CorruptCheckpointError, match=f"{fname}: checksum mismatch"):
        unbroken.verify(ckpt)


def test_the_memory_check_reads_this_machine() -> None:
    avail = local_store.available_memory()
    if not Path("/proc/meminfo").exists():
        assert avail is None
    else:
        assert avail is not None and 0 < avail < 2**50


class _Sink:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor, path: Any) -> dict[str, Any]:
        self.tensors[str(len(self.tensors))] = tensor
        return {"file": "mem", "key": str(len(self.tensors) - 1)}

    def resolve(self, ref: dict[str, Any]) -> torch.Tensor:
        return self.tensors[ref["key"]]


def _zero_key(node: Any, sink: _Sink) -> None:
    for t in sink.tensors.values():
        if t.numel() == 624 * 4 or t.numel() == 624:
            t.zero_()


def _even_inc(node: Any, sink: _Sink) -> None:
    pcg = node["state"]["v"]["state"]["v"]
    pcg["state"], pcg["inc"] = 0, 2


DEGENERATE = {
    "RandomState, all-zero key": (lambda: np.random.RandomState(3), _zero_key),
    "Generator(MT19937), all-zero key": (lambda: np.random.Generator(np.random.MT19937(3)), _zero_key),
    "Generator(PCG64), state 0 and an even increment": (lambda: np.random.Generator(np.random.PCG64(3)), _even_inc),
}


@pytest.mark.parametrize("case", DEGENERATE)
def test_a_numpy_generator_state_that_would_hang_the_training_is_refused(case: str) -> None:
    """Checksum-valid numpy generator states no seeding produces, which make numpy's bounded
    integer and normal draws loop forever (measured: a hang, in C, no signal can stop it)."""
    from unbroken.state.codec import Encoder
    from unbroken.state.decoder import Decoder

    make, spoil = DEGENERATE[case]
    sink = _Sink()
    node = json.loads(json.dumps(Encoder(sink).encode(make())))
    Decoder(sink.resolve).decode(json.loads(json.dumps(node)))  # the real state decodes
    spoil(node, sink)
    with pytest.raises(CorruptCheckpointError, match="zero|even"):
        Decoder(sink.resolve).decode(node)


def test_an_all_zero_global_numpy_state_is_refused() -> None:
    from unbroken.state.rng import GlobalRNG

    state = GlobalRNG().state_dict()
    state["numpy"] = dict(state["numpy"], state={"key": np.zeros(624, np.uint32), "pos": 624})
    with pytest.raises(CorruptCheckpointError, match="all-zero key"):
        GlobalRNG.check(state)
