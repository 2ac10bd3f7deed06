"""Security tests: a checkpoint from a stranger must never run code or touch files
outside the checkpoint.

Every payload here is live: ``test_payloads_are_live`` proves that unpickling them
does create the marker file. The other tests then hand the same payloads to
``verify``, ``load`` and ``Checkpointer.restore`` and check that the marker never
appears, and that nothing in ``pickle``/``torch.load`` is even called.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
from sealing import load_doc, save_doc
import torch

import unbroken
from unbroken import CorruptCheckpointError, StateMismatchError
from unbroken.errors import StorageError
from unbroken.format.manifest import new_hasher

SRC = Path(unbroken.__file__).resolve().parent
MODEL_FILE = "t00-model.safetensors"


# ------------------------------------------------------------------- payloads
class Payload:
    """Unpickling an instance creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def pickle_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker), protocol=4)


def torch_save_bytes(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    return buf.getvalue()


PAYLOADS: dict[str, Callable[[Path], bytes]] = {"pickle": pickle_bytes, "torch_save": torch_save_bytes}


def test_payloads_are_live(tmp_path: Path) -> None:
    """Control: the payloads used below really execute code when unpickled."""
    m1, m2 = tmp_path / "M1", tmp_path / "M2"
    pickle.loads(pickle_bytes(m1))
    assert m1.exists()
    torch.load(io.BytesIO(torch_save_bytes(m2)), weights_only=False)
    assert m2.exists()


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every unpickling entry point fail loudly and record that it was called."""
    calls: list[str] = []

    def trap(name: str) -> Callable[..., Any]:
        def called(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} was called while reading a checkpoint")
        return called

    for mod, attr in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                      (torch, "load"), (torch.serialization, "load")]:
        monkeypatch.setattr(mod, attr, trap(f"{mod.__name__}.{attr}"))
    return calls


# ----------------------------------------------------------------- the run
def make_model(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def fresh_state(seed: int = 1234) -> tuple[torch.nn.Module, dict[str, Any]]:
    model = make_model(seed)
    return model, {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def weights(model: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            for k, v in model.state_dict().items()}


@dataclass
class Template:
    run: Path
    saved: dict[int, dict[str, bytes]]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    run = tmp_path_factory.mktemp("malicious") / "run"
    model, state = fresh_state(seed=0)
    opt = state["optimizer"]
    ckpt = unbroken.Checkpointer(run, save_every=10, keep_last=None)
    saved = {}
    for _ in range(20):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt.step(state) is not None:
            saved[ckpt.progress.step] = weights(model)
    assert sorted(saved) == [10, 20]
    return Template(run, saved)


@pytest.fixture
def run(template: Template, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(template.run, dst, symlinks=True)
    return dst


def digest(raw: bytes) -> str:
    h = new_hasher()
    h.update(raw)
    return h.hexdigest()


def relist(ckpt: Path, fname: str) -> None:
    """Rewrite the manifest entry of ``fname`` so its size and checksum match."""
    raw = (ckpt / fname).read_bytes()
    doc = load_doc(ckpt)
    doc["files"][fname] = {"size": len(raw), "xxh3_128": digest(raw)}
    save_doc(ckpt, doc)


def every_way_to_read(run: Path, ckpt: Path) -> None:
    """verify, load without and with a state, restore exactly this checkpoint."""
    assert unbroken.verify(ckpt).step == 20
    assert isinstance(unbroken.load(ckpt)["model"], dict)
    model, state = fresh_state()
    unbroken.Checkpointer(run, keep_last=None).restore(state, path=ckpt)
    model2, state2 = fresh_state()
    unbroken.load(ckpt, state2, strict=False)  # the run's "__unbroken__" part is not in state2


# ------------------------------------------------------- pickles in the folder
@pytest.mark.parametrize("listed", [False, True], ids=["unlisted", "listed_with_valid_checksum"])
def test_pickle_files_in_a_checkpoint_are_never_unpickled(
    listed: bool, run: Path, template: Template, tmp_path: Path, no_unpickling: list[str]
) -> None:
    marker = tmp_path / "MARKER"
    ckpt = run / "step-000000020"
    (ckpt / "data.pkl").write_bytes(pickle_bytes(marker))
    (ckpt / "model.pt").write_bytes(torch_save_bytes(marker))
    (ckpt / "optimizer.bin").write_bytes(pickle_bytes(marker))
    if listed:
        for f in ("data.pkl", "model.pt", "optimizer.bin"):
            relist(ckpt, f)

    every_way_to_read(run, ckpt)
    model, state = fresh_state()
    info = unbroken.Checkpointer(run, keep_last=None).restore(state)
    assert info is not None and info.step == 20
    assert weights(model) == template.saved[20]
    assert not marker.exists()
    assert no_unpickling == []


@pytest.mark.parametrize("fmt", list(PAYLOADS))
def test_pickle_disguised_as_tensor_file_is_refused(
    fmt: str, run: Path, template: Template, tmp_path: Path, no_unpickling: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    marker = tmp_path / "MARKER"
    bad = run / "step-000000020"
    (bad / MODEL_FILE).write_bytes(PAYLOADS[fmt](marker))
    relist(bad, MODEL_FILE)  # the checksum passes: only the format check can refuse it

    with pytest.raises(CorruptCheckpointError) as err:
        unbroken.verify(bad)
    assert MODEL_FILE in str(err.value)
    with pytest.raises(CorruptCheckpointError):
        unbroken.load(bad)
    model, state = fresh_state()
    before = weights(model)
    with pytest.raises(CorruptCheckpointError) as err:
        unbroken.Checkpointer(run, keep_last=None).restore(state, path=bad)
    assert MODEL_FILE in str(err.value)
    assert weights(model) == before

    caplog.set_level(logging.INFO, logger="unbroken")
    info = unbroken.Checkpointer(run, keep_last=None).restore(state)
    assert info is not None and info.step == 10
    assert weights(model) == template.saved[10]
    assert (run / "quarantine" / bad.name).is_dir()
    assert MODEL_FILE in (run / "quarantine" / f"{bad.name}.reason.txt").read_text()
    assert not marker.exists()
    assert no_unpickling == []


def test_state_json_pointing_at_a_pickle_is_refused(
    run: Path, tmp_path: Path, no_unpickling: list[str]
) -> None:
    marker = tmp_path / "MARKER"
    bad = run / "step-000000020"
    (bad / "model.pt").write_bytes(torch_save_bytes(marker))
    relist(bad, "model.pt")
    tree = json.loads((bad / "state.json").read_text())
    params = tree["state"]["model"]["v"]["v"]
    params["0.weight"] = {"@": "tensor", "file": "model.pt", "key": "model/0.weight", "device": "cpu"}
    (bad / "state.json").write_text(json.dumps(tree))
    relist(bad, "state.json")

    with pytest.raises(CorruptCheckpointError) as err:
        unbroken.verify(bad)
    assert "model.pt" in str(err.value)
    assert not marker.exists()
    assert no_unpickling == []


# ---------------------------------------------- "stateful" classes by name
@pytest.mark.parametrize("cls, kwargs", [
    ("os.system", lambda m: {"command": f"touch {m}"}),
    ("subprocess.check_call", lambda m: {"args": ["touch", str(m)]}),
    ("subprocess.getoutput", lambda m: {"cmd": f"touch {m}"}),
    ("pathlib.Path.touch", lambda m: {"self": str(m)}),
])
def test_stateful_class_name_is_never_imported_or_called(
    cls: str, kwargs: Callable[[Path], dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    no_unpickling: list[str],
) -> None:
    """A state.json node ``{"@": "stateful", "class": "os.system", "v": {...}}`` is data.

    Its ``v`` is chosen so that a naive decoder doing ``import_module(...)`` and
    ``cls(**v)`` would run the command.
    """
    marker = tmp_path / "MARKER"
    path = tmp_path / "ckpt"
    unbroken.save(path, {"model": make_model(0), "job": kwargs(marker)})
    tree = json.loads((path / "state.json").read_text())
    tree["state"]["job"] = {"@": "stateful", "class": cls, "v": tree["state"]["job"]}
    (path / "state.json").write_text(json.dumps(tree))
    relist(path, "state.json")

    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(("os.system", a, k)))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: calls.append(("Popen", a, k)))
    import importlib
    real_import_module = importlib.import_module

    def import_module(name: str, *a: Any, **k: Any) -> Any:
        calls.append(("import_module", name))
        return real_import_module(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", import_module)

    assert unbroken.verify(path).step == 0
    # Into a live plain dict: refused, naming the saved class.
    model = make_model(1)
    with pytest.raises(StateMismatchError) as err:
        unbroken.load(path, {"model": model, "job": {}})
    assert cls in str(err.value)
    with pytest.raises(StateMismatchError):
        unbroken.Checkpointer(tmp_path / "run").restore({"model": make_model(2), "job": {}}, path=path)
    # Without a state: plain data.
    plain = unbroken.load(path)
    assert plain["job"] == kwargs(marker)

    # Into a live Stateful object: it receives the plain dict, nothing else happens.
    class Job:
        got: Any = None

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, d: Any) -> None:
            self.got = d

    job = Job()
    unbroken.load(path, {"model": make_model(3), "job": job})
    assert job.got == kwargs(marker)

    assert not marker.exists()
    # The only process unbroken starts is `git` in the working directory (the environment
    # fingerprint of the *current* code): nothing named by the checkpoint.
    own_git = [c for c in calls if c[0] == "Popen" and c[1][0][0] == "git" and "core.fsmonitor=false" in c[1][0]]
    assert [c for c in calls if c not in own_git and (c[0] != "import_module" or c[1].split(".")[0] in
            ("os", "subprocess", "pathlib", "builtins"))] == []
    assert no_unpickling == []


# ------------------------------------------------ the source never unpickles
FORBIDDEN_CODE = [
    r"\bpickle\b", r"\b_pickle\b", r"\bcloudpickle\b", r"\bdill\b", r"\bjoblib\b", r"\bmarshal\b",
    r"\bshelve\b", r"\bcopyreg\b", r"\btorch\s*\.\s*load\b", r"\btorch\s*\.\s*serialization\b",
    r"\bweights_only\b", r"\ballow_pickle\b",
    r"__import__", r"\bimportlib\b(?!\s*\.\s*metadata\b)", r"\bimport_module\b", r"\brunpy\b",
    r"\bpydoc\s*\.\s*locate\b",
]


def code_without_strings_and_comments(source: str) -> str:
    """The source with every string literal and comment removed (docstrings may say 'pickle')."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            continue
        if hasattr(tokenize, "FSTRING_MIDDLE") and tok.type == tokenize.FSTRING_MIDDLE:
            continue
        out.append(tok.string)
    return " ".join(out)


def violations(source: str) -> list[str]:
    code = code_without_strings_and_comments(source)
    found = [p for p in FORBIDDEN_CODE if re.search(p, code)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name != "importlib.metadata"
                      and a.name.split(".")[0] in ("pickle", "_pickle", "marshal", "shelve", "importlib", "dill")]
        elif isinstance(node, ast.ImportFrom) and node.module != "importlib.metadata" and (
                node.module or "").split(".")[0] in ("pickle", "_pickle", "marshal", "shelve", "importlib", "dill"):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(
                a.name in ("load", "serialization") for a in node.names):
            found.append("from torch import load")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "eval", "exec", "__import__", "compile"):
            found.append(f"{node.func.id}()")
    return found


def test_source_scanner_catches_unpickling() -> None:
    """Control: the scanner below does flag the constructs it is meant to forbid."""
    assert violations("import pickle\n")
    assert violations("from importlib import import_module\n")
    assert violations("import importlib\n")
    # package metadata (versions for the environment fingerprint) reads files, runs no code
    assert not violations("import importlib.metadata\nv = importlib.metadata.version('torch')\n")
    assert violations("import torch\nx = torch.load(f)\n")
    assert violations("from torch import load\n")
    assert violations("y = eval('1')\n")
    assert violations("exec(code)\n")
    assert violations("m = __import__('os')\n")
    assert violations("import numpy as np\nnp.load(f, allow_pickle=True)\n")
    assert violations('"""never unpickle"""\n# pickle is banned\nx = "torch.load(f)"\nimport json\n') == []


PICKLE_READER = "convert/pickles.py"
"""The one audited exception: ``unbroken import`` reads other tools' ``torch.save`` files, with
``weights_only=True`` unless the user passes ``--trust-pickle``. Nothing that reads unbroken
checkpoints can reach it (test below)."""


def test_package_source_never_unpickles_or_evaluates() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) >= 10 and SRC / "checkpoint" / "reader.py" in files
    bad = {str(f.relative_to(SRC)): v for f in files if (v := violations(f.read_text(encoding="utf-8")))}
    # passes Lightning's own ``weights_only`` argument through to Lightning's loader, for a plain
    # ``.ckpt`` file the user names in ``ckpt_path=`` (what Lightning does without unbroken)
    assert bad.pop("integrations/lightning/checkpoint_io.py", []) == [r"\bweights_only\b"]
    # the selftest compiles the user's own training script (a file it was told to run, never a
    # checkpoint's bytes) for its line tables, to say which lines never ran; the code is not executed
    assert bad.pop("selftest/lines.py", []) == ["compile()"]
    # `unbroken run`'s spare runs the user's own training command (the script or module named on its command
    # line, never a checkpoint's bytes) and imports the modules the supervisor names (torch, ``--preload``)
    assert sorted(bad.pop("launch/spare.py", [])) == sorted(
        [r"\bimportlib\b(?!\s*\.\s*metadata\b)", r"\bimport_module\b", r"\brunpy\b", "import importlib"])
    # the spare server's forker imports the modules the server names (its fixed ``PRELOAD``), then forks spares
    assert sorted(bad.pop("launch/forker.py", [])) == sorted(
        [r"\bimportlib\b(?!\s*\.\s*metadata\b)", r"\bimport_module\b", "import importlib"])
    # the package's lazy names (PEP 562): imports only its own modules, from a fixed table or a
    # subpackage name (audited by the test below)
    assert sorted(bad.pop("__init__.py", [])) == sorted(
        [r"\bimportlib\b(?!\s*\.\s*metadata\b)", r"\bimport_module\b", "import importlib", "import importlib.util"])
    assert sorted(bad.pop(PICKLE_READER, [])) == sorted(
        [r"\bpickle\b", r"\btorch\s*\.\s*load\b", r"\btorch\s*\.\s*serialization\b", r"\bweights_only\b",
         "import pickle"]), "the pickle reader changed: audit it again"
    assert bad == {}


def test_the_lazy_package_imports_only_its_own_modules() -> None:
    """``unbroken.<name>`` imports a module of this package named in its table, or one of its own
    subpackages; any other name, a dotted or relative one, or a module outside the package is an
    AttributeError and imports nothing."""
    import unbroken

    before = set(sys.modules)
    for name in ("os", "pickle", "json", "..os", "data.x", ".data", "__main__", "sys", ""):
        with pytest.raises(AttributeError):
            unbroken.__getattr__(name)
    assert {m for m in set(sys.modules) - before if not m.startswith("unbroken")} == set()
    assert unbroken.__getattr__("errors").__name__ == "unbroken.errors"
    assert unbroken.__getattr__("Checkpointer").__module__ == "unbroken.checkpointer.manager"


def test_the_pickle_reader_is_safe_by_default_and_unreachable_from_checkpoint_reading() -> None:
    """``convert/pickles.py`` calls the full unpickler only behind ``trust``, and only the import
    command's modules import it: restore, load, verify and every other path never can."""
    source = (SRC / PICKLE_READER).read_text(encoding="utf-8")
    loads = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.load"]
    kinds = sorted(next(ast.unparse(k.value) for k in call.keywords if k.arg == "weights_only") for call in loads)
    assert kinds == ["False", "True"]
    assert "if not trust:" in source and source.index("if not trust:") < source.index("weights_only=False")
    importers = set()
    for f in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.endswith("convert") or node.module.endswith("pickles") or "convert." in node.module):
                importers.add(str(f.relative_to(SRC)))
    assert importers <= {"convert/__init__.py", "convert/importing.py", "convert/deepspeed.py",
                         "cli/convert.py"}, importers


# --------------------------------------------------------- symlinked folders
def test_symlinked_checkpoint_folder_outside_the_run_is_refused(
    run: Path, template: Template, tmp_path: Path
) -> None:
    """A checkpoint folder that is a symlink to elsewhere makes the run refused, by name.

    The outside folder is a *valid* checkpoint with a higher step and seq, so a
    discovery that followed links would pick it; nothing is read from it or moved.
    """
    outside = tmp_path / "elsewhere" / "evil"
    shutil.copytree(run / "step-000000020", outside)
    doc = load_doc(outside)
    doc["step"], doc["seq"] = 99, 99
    save_doc(outside, doc)
    assert unbroken.verify(outside).step == 99
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    (run / "step-000000099").symlink_to(outside, target_is_directory=True)

    with pytest.raises(StorageError, match="symbolic links.*step-000000099"):
        unbroken.Checkpointer(run, keep_last=None)
    assert (run / "step-000000099").is_symlink()           # not quarantined or moved
    assert not (run / "quarantine").exists()
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    (run / "step-000000099").unlink()
    model, state = fresh_state()
    info = unbroken.Checkpointer(run, keep_last=None).restore(state)
    assert info is not None and info.step == 20 and weights(model) == template.saved[20]


PLANTED = {  # an entry unbroken manages -> (how to plant the link, what it points at)
    ".lock": "file",
    "tags.json": "/dev/zero",
    "index.sqlite": "file",
    "index.sqlite-wal": "file",
    "quarantine": "dir",
    ".staging-host_123_0123abcd_step-000000030": "dir",
    ".trash-host_123_0123abcd_step-000000010": "dir",
}


@pytest.mark.parametrize("entry", PLANTED)
def test_a_planted_link_where_unbroken_keeps_its_files_is_refused_and_its_target_untouched(
    run: Path, tmp_path: Path, entry: str
) -> None:
    """A run folder on a shared, group-writable filesystem: a link planted where unbroken
    keeps a file would lead a write, a rename or a delete out of the run. The Checkpointer
    refuses the run naming the link, and the target is unchanged (a folder still holds its
    files; a file its bytes); the CLI says the same, without a traceback."""
    kind = PLANTED[entry]
    outside = tmp_path / "outside"
    outside.mkdir()
    if kind == "file":
        target = outside / "victim"
        target.write_bytes(b"precious")
    elif kind == "dir":
        target = outside / "folder"
        target.mkdir()
        (target / "keep.txt").write_text("precious")
    else:
        target = Path(kind)
    if (run / entry).is_dir() and not (run / entry).is_symlink():
        shutil.rmtree(run / entry)
    (run / entry).unlink(missing_ok=True)  # the real file the template run has (.lock, index)
    (run / entry).symlink_to(target, target_is_directory=kind == "dir")
    with pytest.raises(StorageError, match=re.escape(entry)):
        unbroken.Checkpointer(run, keep_last=None)
    if kind == "file":
        assert target.read_bytes() == b"precious"
    elif kind == "dir":
        assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert (run / entry).is_symlink()
    listed = subprocess.run([sys.executable, "-m", "unbroken.cli", "list", str(run)], capture_output=True,
                            text=True, timeout=120)
    out = " ".join((listed.stdout + listed.stderr).split())
    assert listed.returncode != 0 and "symbolic links" in out and entry in out, out
    assert "Traceback" not in out


def test_explicit_path_to_a_symlinked_checkpoint_folder_is_followed(run: Path, tmp_path: Path) -> None:
    """Documents current behaviour: a path the user names explicitly is used as given.

    Only the folder itself may be a link; files inside it are still opened with
    O_NOFOLLOW (see test_corruption's symlink cases).
    """
    outside = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(run / "step-000000020", outside)
    link = run / "linked"
    link.symlink_to(outside, target_is_directory=True)
    assert unbroken.verify(link).step == 20
    model, state = fresh_state()
    assert unbroken.Checkpointer(run, keep_last=None).restore(state, path=link).step == 20


# ------------------------------------------- planted links in the quarantine
def test_planted_reason_file_link_is_not_written_through(
    run: Path, template: Template, tmp_path: Path
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    bad = run / "step-000000020"
    (bad / MODEL_FILE).write_bytes(b"broken")
    (run / "quarantine").mkdir()
    (run / "quarantine" / f"{bad.name}.reason.txt").symlink_to(victim)

    model, state = fresh_state()
    info = unbroken.Checkpointer(run, keep_last=None).restore(state)
    assert info is not None and info.step == 10
    assert weights(model) == template.saved[10]
    assert victim.read_text() == "precious"
    moved = [p for p in (run / "quarantine").iterdir() if p.is_dir()]
    assert len(moved) == 1 and moved[0].name.startswith(bad.name)
    reason = run / "quarantine" / f"{moved[0].name}.reason.txt"
    assert not reason.is_symlink() and MODEL_FILE in reason.read_text()


def test_planted_quarantine_link_does_not_move_checkpoints_outside(
    run: Path, template: Template, tmp_path: Path
) -> None:
    """Planted after the Checkpointer checked the run (which refuses it up front): the
    quarantine move itself still does not follow the link."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt = unbroken.Checkpointer(run, keep_last=None)
    (run / "quarantine").symlink_to(elsewhere, target_is_directory=True)
    bad = run / "step-000000020"
    (bad / MODEL_FILE).write_bytes(b"broken")

    model, state = fresh_state()
    info = ckpt.restore(state)
    assert info is not None and info.step == 10
    assert weights(model) == template.saved[10]
    assert list(elsewhere.iterdir()) == []
