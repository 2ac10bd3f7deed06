"""Fault tests: a damaged checkpoint is refused, quarantined and skipped.

Scenario for every kind of damage: a run folder holds checkpoints at steps 10, 20
and 30 written by ``unbroken.Checkpointer``; the newest (step 30) is damaged in one
way. Then

* ``unbroken.verify`` on it raises ``CorruptCheckpointError`` naming the problem,
  without any huge allocation (it runs under an address-space limit);
* ``restore(state, path=damaged)`` raises ``CorruptCheckpointError`` and leaves the
  live model and optimizer untouched;
* a fresh ``Checkpointer.restore(state)`` into fresh objects does not raise, returns
  step 20, loads exactly (bitwise) the values saved at step 20, moves the damaged
  folder to ``<run>/quarantine/`` with a ``<name>.reason.txt`` naming the problem,
  and logs a warning.

Many damages are "recomputed": the manifest's size and checksum are rewritten to
match the tampered bytes, so that only the specific protection under test (name
checks, header validation, tag allow-lists, O_NOFOLLOW, ...) can catch them. Had
that protection been removed, the checkpoint would verify and step 30 would load.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
from sealing import load_doc, save_doc, write_text

from unbroken.format.manifest import FORMAT_VERSION
import torch

import unbroken
from unbroken import CorruptCheckpointError
from unbroken.format.manifest import new_hasher

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None  # type: ignore[assignment]

MODEL_FILE = "t00-model.safetensors"
OPT_FILE = "t01-optimizer.safetensors"
STEPS = (10, 20, 30)


# --------------------------------------------------------------------- the run
def make_model(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def fresh_state(seed: int = 1234) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, {"model": model, "optimizer": opt}


def values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Deep copies of everything that must come back bitwise."""
    sd = opt.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "opt_state": {(pid, k): (v.clone() if isinstance(v, torch.Tensor) else v)
                      for pid, st in sd["state"].items() for k, v in st.items()},
        "opt_groups": json.dumps(sd["param_groups"], sort_keys=True, default=str),
    }


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            == b.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())


def assert_bitwise(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["model"].keys() == expected["model"].keys()
    for k in expected["model"]:
        assert _same_tensor(actual["model"][k], expected["model"][k]), f"model {k} differs"
    assert actual["opt_state"].keys() == expected["opt_state"].keys()
    for k, v in expected["opt_state"].items():
        got = actual["opt_state"][k]
        if isinstance(v, torch.Tensor):
            assert isinstance(got, torch.Tensor) and _same_tensor(got, v), f"optimizer {k} differs"
        else:
            assert got == v, f"optimizer {k} differs"
    assert actual["opt_groups"] == expected["opt_groups"]


@dataclass
class Template:
    run: Path
    saved: dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    run = tmp_path_factory.mktemp("template") / "run"
    model, opt, state = fresh_state(seed=0)
    data = torch.Generator().manual_seed(1)
    ckpt = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    saved: dict[int, dict[str, Any]] = {}
    for _ in range(STEPS[-1]):
        loss = model(torch.randn(3, 4, generator=data)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt.step(state, loss=loss) is not None:
            saved[ckpt.progress.step] = values(model, opt)
    assert sorted(saved) == list(STEPS)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith((".", "index.sqlite"))) == [
        f"step-{s:09d}" for s in STEPS]
    # The damages below rely on this layout.
    assert {MODEL_FILE, OPT_FILE, "state.json", "manifest.json"} <= {
        p.name for p in (run / "step-000000030").iterdir()}
    return Template(run, saved)


@pytest.fixture
def run(template: Template, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(template.run, dst, symlinks=True)
    return dst


# ------------------------------------------------------------------ damage tools
def digest(raw: bytes) -> str:
    h = new_hasher()
    h.update(raw)
    return h.hexdigest()


def load_manifest(ckpt: Path) -> dict[str, Any]:
    return load_doc(ckpt)


def save_manifest(ckpt: Path, doc: dict[str, Any]) -> None:
    save_doc(ckpt, doc)  # with a valid self-checksum: the attack reaches the checks behind it


def relist(ckpt: Path, fname: str, raw: bytes | None = None) -> None:
    """Make the manifest's size and checksum of ``fname`` match ``raw`` (default: its bytes)."""
    if raw is None:
        raw = (ckpt / fname).read_bytes()
    doc = load_manifest(ckpt)
    doc["files"][fname] = {"size": len(raw), "xxh3_128": digest(raw)}
    save_manifest(ckpt, doc)


def flip(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))


def header_size(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def rewrite_header(ckpt: Path, fname: str, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Edit a safetensors header, keep the data, and recompute the manifest entry."""
    path = ckpt / fname
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    mutate(header)
    head = json.dumps(header).encode()
    head += b" " * (-(len(head) + 8) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    relist(ckpt, fname)


def write_state_json(ckpt: Path, text: str | bytes) -> None:
    raw = text.encode() if isinstance(text, str) else text
    (ckpt / "state.json").write_bytes(raw)
    relist(ckpt, "state.json")


def edit_state(ckpt: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    tree = json.loads((ckpt / "state.json").read_text())
    mutate(tree)
    write_state_json(ckpt, json.dumps(tree, separators=(",", ":")))


def tensor_nodes(node: Any, file: str | None = None):
    """Every tensor reference node in a state.json tree (optionally of one file)."""
    if isinstance(node, dict):
        if node.get("@") == "tensor" and (file is None or node.get("file") == file):
            yield node
        for v in node.values():
            yield from tensor_nodes(v, file)
    elif isinstance(node, list):
        for v in node:
            yield from tensor_nodes(v, file)


def model_params(tree: dict[str, Any]) -> dict[str, Any]:
    """The ``{"0.weight": <tensor node>, ...}`` object of the saved model."""
    return tree["state"]["model"]["v"]["v"]


# -------------------------------------------------------------------- damages
# Each damage edits the step-30 folder and returns the substrings the error
# message must contain (checked with the checkpoint's own path blanked out, so a
# match cannot come from the folder name).
Damage = Callable[[Path, Path], list[str]]
DAMAGES: dict[str, Damage] = {}


def damage(name: str) -> Callable[[Damage], Damage]:
    def register(fn: Damage) -> Damage:
        DAMAGES[name] = fn
        return fn
    return register


@damage("truncated_tensor_file")
def _(ckpt: Path, tmp: Path) -> list[str]:
    path = ckpt / MODEL_FILE
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) * 2 // 3])
    return [MODEL_FILE, "bytes"]


@damage("flipped_byte_in_tensor_data")
def _(ckpt: Path, tmp: Path) -> list[str]:
    path = ckpt / MODEL_FILE
    start = 8 + header_size(path)
    size = path.stat().st_size
    flip(path, start + (size - start) // 2)  # inside the data section, not the header
    return [MODEL_FILE, "checksum"]


@damage("flipped_byte_in_state_json")
def _(ckpt: Path, tmp: Path) -> list[str]:
    path = ckpt / "state.json"
    flip(path, path.stat().st_size // 2)
    return ["state.json", "checksum"]


@damage("missing_tensor_file")
def _(ckpt: Path, tmp: Path) -> list[str]:
    (ckpt / OPT_FILE).unlink()
    return [OPT_FILE, "missing"]


@damage("missing_manifest")
def _(ckpt: Path, tmp: Path) -> list[str]:
    (ckpt / "manifest.json").unlink()  # data files are all there
    return ["manifest.json", "missing"]


@damage("half_written_manifest")
def _(ckpt: Path, tmp: Path) -> list[str]:
    raw = (ckpt / "manifest.json").read_bytes()
    (ckpt / "manifest.json").write_bytes(raw[: len(raw) // 2])
    return ["manifest.json", "parse"]


@damage("garbage_manifest")
def _(ckpt: Path, tmp: Path) -> list[str]:
    (ckpt / "manifest.json").write_bytes(random.Random(7).randbytes(900))
    return ["manifest.json", "parse"]


@damage("empty_manifest")
def _(ckpt: Path, tmp: Path) -> list[str]:
    (ckpt / "manifest.json").write_bytes(b"")
    return ["manifest.json", "parse"]


@damage("manifest_with_wrong_checksum")
def _(ckpt: Path, tmp: Path) -> list[str]:
    doc = load_manifest(ckpt)
    doc["files"][MODEL_FILE]["xxh3_128"] = digest(b"not the model")  # well-formed, wrong
    save_manifest(ckpt, doc)
    return [MODEL_FILE, "checksum"]


def _escape(name: str) -> Damage:
    """List ``name`` in the manifest with the size and checksum of the file it points to."""

    def apply(ckpt: Path, tmp: Path) -> list[str]:
        if name.startswith("/"):
            target = Path(name)
            if not target.is_file():
                pytest.skip(f"{name} does not exist here")
        else:
            target = ckpt / name  # e.g. run/step/../../etc/passwd == tmp/etc/passwd
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
        relist(ckpt, name, target.read_bytes())
        return ["unsafe", repr(name)]

    return apply


DAMAGES["manifest_lists_dotdot_path"] = _escape("../../etc/passwd")
DAMAGES["manifest_lists_absolute_path"] = _escape("/etc/passwd")
DAMAGES["manifest_lists_subdir_path"] = _escape("a/b")


@damage("manifest_with_duplicate_file_entry")
def _(ckpt: Path, tmp: Path) -> list[str]:
    # A last-wins parser would see only the (valid) second entry and accept it.
    text = json.dumps(load_manifest(ckpt))
    bogus = json.dumps({"size": 1, "xxh3_128": "0" * 32})
    text = text.replace('"files": {', f'"files": {{"{MODEL_FILE}": {bogus}, ', 1)
    assert text.count(f'"{MODEL_FILE}"') == 2
    write_text(ckpt, text)
    return ["duplicate", MODEL_FILE]


@damage("manifest_with_duplicate_top_level_key")
def _(ckpt: Path, tmp: Path) -> list[str]:
    text = json.dumps(load_manifest(ckpt))
    text = text.replace('{"format": ', '{"format_version": 999, "format": ', 1)
    write_text(ckpt, text)
    return ["duplicate", "format_version"]


@damage("manifest_nested_100000_levels")
def _(ckpt: Path, tmp: Path) -> list[str]:
    text = json.dumps(load_manifest(ckpt))
    deep = "[" * 100_000 + "]" * 100_000
    write_text(ckpt, text[:-1] + f', "extra": {deep}}}')
    return ["manifest.json", "parse"]


@damage("tensor_file_is_symlink_to_identical_outside_file")
def _(ckpt: Path, tmp: Path) -> list[str]:
    outside = tmp / "outside"
    outside.mkdir()
    (outside / MODEL_FILE).write_bytes((ckpt / MODEL_FILE).read_bytes())  # same size, same checksum
    (ckpt / MODEL_FILE).unlink()
    (ckpt / MODEL_FILE).symlink_to(outside / MODEL_FILE)
    return [MODEL_FILE, "symbolic link"]


@damage("state_json_is_symlink_to_identical_outside_file")
def _(ckpt: Path, tmp: Path) -> list[str]:
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "state.json").write_bytes((ckpt / "state.json").read_bytes())
    (ckpt / "state.json").unlink()
    (ckpt / "state.json").symlink_to(outside / "state.json")
    return ["state.json", "symbolic link"]


@damage("header_with_absurd_shape")
def _(ckpt: Path, tmp: Path) -> list[str]:
    def mutate(h: dict[str, Any]) -> None:
        h["model/0.weight"]["shape"] = [10**12, 10**12]  # offsets left as they were

    rewrite_header(ckpt, MODEL_FILE, mutate)
    return [MODEL_FILE, "model/0.weight", "does not fit"]


@damage("header_with_absurd_consistent_size")
def _(ckpt: Path, tmp: Path) -> list[str]:
    def mutate(h: dict[str, Any]) -> None:
        # Shape and offsets agree with each other (4 TB), but not with the file.
        h["model/0.weight"] = {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}

    rewrite_header(ckpt, MODEL_FILE, mutate)
    return [MODEL_FILE, "model/0.weight", "does not fit"]


@damage("header_length_field_absurd")
def _(ckpt: Path, tmp: Path) -> list[str]:
    path = ckpt / MODEL_FILE
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    relist(ckpt, MODEL_FILE)
    return [MODEL_FILE, "header claims"]


@damage("header_nested_100000_levels")
def _(ckpt: Path, tmp: Path) -> list[str]:
    head = ("[" * 100_000 + "]" * 100_000).encode()
    head += b" " * (-(len(head) + 8) % 8)
    (ckpt / MODEL_FILE).write_bytes(struct.pack("<Q", len(head)) + head)
    relist(ckpt, MODEL_FILE)
    return [MODEL_FILE, "header"]


@damage("state_json_refers_to_unlisted_file")
def _(ckpt: Path, tmp: Path) -> list[str]:
    # The file exists and is a valid copy; only the manifest check can refuse it.
    shutil.copyfile(ckpt / MODEL_FILE, ckpt / "t09-extra.safetensors")

    def mutate(tree: dict[str, Any]) -> None:
        for node in tensor_nodes(tree, MODEL_FILE):
            node["file"] = "t09-extra.safetensors"

    edit_state(ckpt, mutate)
    return ["unlisted", "t09-extra.safetensors"]


@damage("state_json_refers_to_listed_non_tensor_file")
def _(ckpt: Path, tmp: Path) -> list[str]:
    def mutate(tree: dict[str, Any]) -> None:
        next(tensor_nodes(tree, MODEL_FILE))["file"] = "state.json"

    edit_state(ckpt, mutate)
    return ["'state.json'"]


@damage("state_json_unknown_type_tag")
def _(ckpt: Path, tmp: Path) -> list[str]:
    def mutate(tree: dict[str, Any]) -> None:
        tree["state"]["model"]["v"]["@"] = "os.system"  # the model's state-dict node

    edit_state(ckpt, mutate)
    return ["unknown tag", "'os.system'"]


@damage("state_json_nested_100000_levels")
def _(ckpt: Path, tmp: Path) -> list[str]:
    deep = "[" * 100_000 + "1" + "]" * 100_000
    write_state_json(ckpt, '{"state":{"model":' + deep + "}}")
    return ["state"]


@damage("state_json_nested_600_tagged_levels")
def _(ckpt: Path, tmp: Path) -> list[str]:
    # Shallow enough for the JSON parser, deep for the decoder.
    deep = '{"@":"tuple","v":[' * 600 + "1" + "]}" * 600
    write_state_json(ckpt, '{"state":{"model":' + deep + "}}")
    return ["state"]


@damage("state_json_garbage_with_matching_checksum")
def _(ckpt: Path, tmp: Path) -> list[str]:
    write_state_json(ckpt, random.Random(3).randbytes(500))
    return ["state.json", "parse"]


def _dtype_tag(name: str) -> Damage:
    def apply(ckpt: Path, tmp: Path) -> list[str]:
        def mutate(tree: dict[str, Any]) -> None:
            model_params(tree)["0.bias"] = {"@": "dtype", "v": name}

        edit_state(ckpt, mutate)
        return ["dtype", repr(name)]

    return apply


for _name in ("nn", "load", "float32.__class__", "__builtins__"):
    DAMAGES[f"state_json_dtype_tag_{_name}"] = _dtype_tag(_name)


# ----------------------------------------------------------------- assertions
def problem(text: str, ckpt: Path) -> str:
    """The message with the checkpoint's location blanked out."""
    return text.replace(str(ckpt), "<ckpt>").replace(ckpt.name, "<name>")


def assert_names(text: str, ckpt: Path, expected: list[str]) -> None:
    p = problem(text, ckpt)
    for s in expected:
        assert s in p, f"{s!r} not in {p!r}"


@contextlib.contextmanager
def address_space_limit(extra: int = 4 << 30):
    """Cap this process's virtual memory at its current size + ``extra`` bytes.

    Any attempt to allocate a buffer the size an absurd header or a sparse file
    claims then fails with MemoryError instead of passing silently.
    """
    if resource is None or not Path("/proc/self/status").exists():
        yield
        return
    vm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
              if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + extra
    if hard != resource.RLIM_INFINITY and hard < limit:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def unbroken_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "unbroken" and r.levelno == level]


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", list(DAMAGES))
def test_damaged_newest_checkpoint_is_refused_quarantined_and_skipped(
    kind: str, run: Path, template: Template, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = run / "step-000000030"
    expected = DAMAGES[kind](bad, tmp_path)
    outside_before = {p: p.read_bytes() for p in tmp_path.rglob("*")
                      if p.is_file() and not p.is_symlink() and run not in p.parents}

    # verify: refuses and names the problem, without allocating what a header claims.
    with address_space_limit(), pytest.raises(CorruptCheckpointError) as err:
        unbroken.verify(bad)
    assert_names(str(err.value), bad, expected)

    # restore of exactly this checkpoint: refuses, live state untouched.
    model, opt, state = fresh_state()
    before = values(model, opt)
    with pytest.raises(CorruptCheckpointError) as err:
        unbroken.Checkpointer(run, save_every=10, keep_last=None).restore(state, path=bad)
    assert_names(str(err.value), bad, expected)
    assert_bitwise(values(model, opt), before)

    # restore of the run: falls back to step 20, bitwise.
    caplog.set_level(logging.INFO, logger="unbroken")
    model, opt, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    info = ckpt.restore(state)
    assert info is not None and info.step == 20 and info.name == "step-000000020"
    assert ckpt.progress.step == 20
    assert_bitwise(values(model, opt), template.saved[20])

    # the damaged folder is quarantined with its reason, the others are untouched.
    assert not os.path.lexists(bad)
    assert (run / "quarantine" / bad.name).is_dir()
    reason = (run / "quarantine" / f"{bad.name}.reason.txt").read_text()
    assert_names(reason, bad, expected)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith((".", "index.sqlite"))) == [
        "quarantine", "step-000000010", "step-000000020"]
    assert [c.step for c in ckpt.checkpoints()] == [20, 10]

    # a warning names the checkpoint and the problem.
    warnings = unbroken_records(caplog, logging.WARNING)
    assert any(bad.name in w and all(s in problem(w, bad) for s in expected) for w in warnings), warnings

    # nothing outside the run was modified (escape targets, symlink targets).
    for p, raw in outside_before.items():
        assert p.read_bytes() == raw, f"{p} was modified"


def test_all_checkpoints_damaged_raises_instead_of_starting_at_step_0(run: Path, caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every checkpoint damaged: restore refuses to train from step 0 (the silent loss measured in
    Lightning), names each checkpoint and its damage, and keeps refusing after a relaunch (the
    damaged ones are in quarantine/ by then) until the user starts fresh on purpose."""
    DAMAGES["flipped_byte_in_tensor_data"](run / "step-000000010", run.parent)
    DAMAGES["missing_manifest"](run / "step-000000020", run.parent)
    DAMAGES["truncated_tensor_file"](run / "step-000000030", run.parent)
    caplog.set_level(logging.INFO, logger="unbroken")
    model, opt, state = fresh_state()
    before = values(model, opt)

    ckpt = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    with pytest.raises(unbroken.NoValidCheckpointError) as err:
        ckpt.restore(state)
    message = str(err.value)
    # each named with what tells it from a later checkpoint of its name (seq and creation time)
    assert re.search(r"step-000000010 \(seq \d+, created [^)]+\): t00-model.safetensors: checksum mismatch", message)
    assert re.search(r"step-000000020 \((inode|seq) [^)]+\): manifest.json is missing", message)
    assert re.search(rf"step-000000030 \(seq [^)]+\): {re.escape(MODEL_FILE)} has", message)
    assert 'if_unrestorable="start_fresh"' in message and "UNBROKEN_START_FRESH=1" in message
    assert ckpt.progress.step == 0
    assert_bitwise(values(model, opt), before)
    names = [f"step-{s:09d}" for s in STEPS]
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith((".", "index.sqlite"))) == ["quarantine"]
    q = run / "quarantine"
    assert sorted(p.name for p in q.iterdir()) == sorted(names + [f"{n}.reason.txt" for n in names])
    assert "checksum" in (q / "step-000000010.reason.txt").read_text()
    assert "manifest.json" in (q / "step-000000020.reason.txt").read_text()
    assert MODEL_FILE in (q / "step-000000030.reason.txt").read_text()
    assert len(unbroken_records(caplog, logging.WARNING)) >= 3
    assert ckpt.checkpoints() == []
    ckpt.close()

    again = unbroken.Checkpointer(run, save_every=10, keep_last=None)  # the relaunch: still refused
    with pytest.raises(unbroken.NoValidCheckpointError, match="(?s)step-000000010.*step-000000020.*step-000000030"):
        again.restore(state)
    assert again.restore(state, if_unrestorable="start_fresh") is None  # on purpose
    assert again.progress.step == 0
    assert_bitwise(values(model, opt), before)
    again.close()
    # a relaunch before the first new save: the fresh start was recorded, no need to keep the override
    third = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    assert third.restore(state) is None
    third.save(state)
    third.close()
    DAMAGES["flipped_byte_in_tensor_data"](run / "step-000000000", run.parent)  # the new run's only one, damaged
    fourth = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    with pytest.raises(unbroken.NoValidCheckpointError, match="step-000000000") as err:
        fourth.restore(state)  # new damage is never covered by the old acknowledgement
    assert "step-000000010" not in str(err.value)
    fourth.close()
    monkeypatch.setenv("UNBROKEN_START_FRESH", "1")  # the same for a script that cannot be edited
    fifth = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    assert fifth.restore(state) is None
    fifth.save(state)
    fifth.close()
    monkeypatch.delenv("UNBROKEN_START_FRESH")
    last = unbroken.Checkpointer(run, save_every=10, keep_last=None)  # a valid checkpoint again: no error
    assert last.restore(state) is not None
    last.close()
    assert sorted(p.name for p in q.iterdir() if p.is_dir()) == sorted(names + ["step-000000000"])  # all kept


@pytest.mark.parametrize("index", ["index kept", "index lost"])
@pytest.mark.parametrize("left", ["in place", "in quarantine"])
def test_a_fresh_start_acknowledges_checkpoints_not_names(tmp_path: Path, left: str, index: str) -> None:
    """A fresh start on purpose records the damaged checkpoints it started past by what they are
    (sequence number and creation time, else the folder's inode), not by name: a fresh start
    numbers its saves from 0 again, so once the old one is gone (deleted by hand, quarantine/
    emptied), a new damaged checkpoint of the same name must raise, never pass as acknowledged
    (with or without the run index remembering it)."""
    run = tmp_path / "run"
    model, opt, state = fresh_state()
    name = "step-000000000"
    first = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    assert first.restore(state) is None
    first.save(state)
    first.close()
    if left == "in place":  # a file where quarantine/ should be: the damaged one cannot be moved
        (run / "quarantine").write_text("not a folder\n")
    DAMAGES["flipped_byte_in_tensor_data"](run / name, run.parent)
    refused = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    with pytest.raises(unbroken.NoValidCheckpointError, match=name):
        refused.restore(state)
    refused.close()

    fresh = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    assert fresh.restore(state, if_unrestorable="start_fresh") is None  # on purpose: recorded
    assert "identity unknown" not in (run / "fresh-starts.json").read_text()
    shutil.rmtree(run / name if left == "in place" else run / "quarantine" / name)  # the old one is gone
    if left == "in quarantine":
        (run / "quarantine" / f"{name}.reason.txt").unlink()
    fresh.save(state)  # takes the old name again
    fresh.close()
    assert (run / name).is_dir()
    if index == "index lost":
        (run / "index.sqlite").unlink()
    DAMAGES["flipped_byte_in_tensor_data"](run / name, run.parent)  # the new run's only one, damaged too
    again = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    with pytest.raises(unbroken.NoValidCheckpointError, match=name):
        again.restore(state)  # new damage is never covered by the old acknowledgement
    again.close()


# ------------------------------------------------------- files that can block
def call_guarded(fn: Callable[[], Any], fifos: list[Path], timeout: float = 20.0) -> Any:
    """Run ``fn`` in a thread; if it is stuck opening a FIFO, unstick it and fail."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    stuck = t.is_alive()
    if stuck:
        for fifo in fifos:  # a writer lets a blocked open() return
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
    assert not stuck, "reading the checkpoint blocked on a FIFO"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("fname", ["manifest.json", MODEL_FILE])
def test_fifo_in_place_of_a_file_is_refused_without_blocking(
    fname: str, run: Path, template: Template, caplog: pytest.LogCaptureFixture
) -> None:
    bad = run / "step-000000030"
    (bad / fname).unlink()
    os.mkfifo(bad / fname)

    with pytest.raises(CorruptCheckpointError) as err:
        call_guarded(lambda: unbroken.verify(bad), [bad / fname])
    assert_names(str(err.value), bad, [fname, "not a regular file"])

    caplog.set_level(logging.INFO, logger="unbroken")
    model, opt, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    info = call_guarded(lambda: ckpt.restore(state), [bad / fname])
    assert info is not None and info.step == 20
    assert_bitwise(values(model, opt), template.saved[20])
    assert (run / "quarantine" / bad.name).is_dir()
    assert fname in (run / "quarantine" / f"{bad.name}.reason.txt").read_text()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_extra_unlisted_files_are_never_opened(
    run: Path, template: Template, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files the manifest does not list are ignored: not read, not even opened."""
    ckpt_dir = run / "step-000000030"
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    extras = {
        "notes.fifo": lambda p: os.mkfifo(p),                  # open() would block forever
        "extra.bin": lambda p: p.write_bytes(b"\x00" * 100),
        "link.safetensors": lambda p: p.symlink_to(outside),
        "subdir": lambda p: p.mkdir(),
        "t99-unlisted.safetensors": lambda p: p.write_bytes(b"garbage"),
    }
    for name, make in extras.items():
        make(ckpt_dir / name)

    real_open = os.open
    opened: list[str] = []

    def spy(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    fifo = [ckpt_dir / "notes.fifo"]
    info = call_guarded(lambda: unbroken.verify(ckpt_dir), fifo)
    assert info.step == 30
    model, opt, state = fresh_state()
    ckpt = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    info = call_guarded(lambda: ckpt.restore(state), fifo)
    monkeypatch.undo()

    assert info is not None and info.step == 30
    assert_bitwise(values(model, opt), template.saved[30])
    assert not (run / "quarantine").exists()
    assert any(p.endswith("manifest.json") for p in opened)  # the spy does see reads
    touched = [p for p in opened if Path(p).name in extras or Path(p) == outside]
    assert touched == []
    assert outside.read_text() == "secret"


def test_huge_sparse_manifest_is_refused_before_allocating(run: Path, template: Template) -> None:
    bad = run / "step-000000030"
    with open(bad / "manifest.json", "r+b") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: costs no disk
    with address_space_limit(), pytest.raises(CorruptCheckpointError) as err:
        unbroken.verify(bad)
    assert_names(str(err.value), bad, ["manifest.json", "large"])

    model, opt, state = fresh_state()
    with address_space_limit():
        info = unbroken.Checkpointer(run, save_every=10, keep_last=None).restore(state)
    assert info is not None and info.step == 20
    assert_bitwise(values(model, opt), template.saved[20])
    assert (run / "quarantine" / bad.name).is_dir()


def test_undamaged_run_restores_newest(run: Path, template: Template) -> None:
    """Control for everything above: the copied run itself is valid and loads step 30."""
    for s in STEPS:
        assert unbroken.verify(run / f"step-{s:09d}").step == s
    model, opt, state = fresh_state()
    info = unbroken.Checkpointer(run, save_every=10, keep_last=None).restore(state)
    assert info is not None and info.step == 30
    assert_bitwise(values(model, opt), template.saved[30])
    assert not (run / "quarantine").exists()


def test_checkpoint_from_a_newer_format_is_not_corruption(run: Path) -> None:
    """A newer unbroken's checkpoint is left in place and restore refuses to skip past it."""
    newest = run / "step-000000030"
    doc = load_manifest(newest)
    doc["format_version"] = FORMAT_VERSION + 1
    save_manifest(newest, doc)
    with pytest.raises(unbroken.NewerFormatError, match="upgrade"):
        unbroken.verify(newest)
    model, opt, state = fresh_state()
    before = values(model, opt)
    with pytest.raises(unbroken.NewerFormatError, match=f"version {FORMAT_VERSION + 1}"):
        unbroken.Checkpointer(run, save_every=10, keep_last=None).restore(state)
    assert_bitwise(values(model, opt), before)
    assert newest.is_dir() and not (run / "quarantine").exists()
