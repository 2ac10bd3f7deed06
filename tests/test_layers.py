"""The layer rules of docs/architecture.md, checked by reading every module's imports.

Dependencies point one way: a module imports only from its own layer or lower ones,
and the bottom packages are self-contained (``store/`` needs nothing of ``format/``,
``state/`` or the layers above; ``format/`` and ``state/`` need only ``errors``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

LAYERS: dict[str, int] = {
    # 0: foundations, each package self-contained
    "errors": 0, "console": 0, "exithooks": 0, "events": 0, "_faults": 0, "progress": 0, "policies": 0, "tags": 0,
    "probe": 0, "environment": 0,
    "state": 0, "data": 0, "format": 0, "store": 0,
    # 1: capture, bytes on disk, reading, ranks
    "snapshot": 1, "adapting": 1, "persist": 1, "chunks": 1, "reader": 1, "manifests": 1, "dist": 1, "background": 1,
    "lazy": 1,
    "shm": 1, "filewriter": 1, "runid": 1,
    # 2: single checkpoints, discovery, the index, tiers, the schedule
    "api": 2, "targets": 2, "discovery": 2, "index": 2, "indexfile": 2, "continuity": 2, "tiers": 2, "scheduling": 2,
    "agreement": 2, "ram": 2, "ramfolder": 2, "ramwriter": 2, "rampeers": 2,
    # 3: the run, plug-ins, collectives, restoring into the live state
    "run": 3, "pruning": 3, "choosing": 3, "damage": 3, "recovery": 3, "saved_state": 3, "recorder": 3, "faults": 3,
    "collective": 3,
    "restoring": 3, "selftest": 3, "epochs": 3, "core": 3,
    # 4: the orchestrator
    "manager": 4, "saving": 4, "stepping": 4, "lifecycle": 4,
    # 5: the public surface and thin tools
    "": 5, "cli": 5, "demo": 5, "demo_train": 5, "integrations": 5, "convert": 5, "plotting": 5,
}
SELF_CONTAINED = {"store": {"errors", "exithooks"}, "format": {"errors"}, "state": {"errors"}, "data": set()}


def _top(module: str) -> str:
    parts = module.split(".")[1:]  # drop "unbroken"
    return parts[0] if parts else ""


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted((SRC / "unbroken").rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("").parts
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        package = module if rel[-1] == "__init__" else module.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - (node.level - 1)])
                if node.module:
                    deps.add(f"{base}.{node.module}")
                else:  # from . import x: the module x, or a name the package exports (then the package)
                    deps |= {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") or a.name == "__version__"
                             else base for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("unbroken"):
                deps.add(node.module)  # type: ignore[arg-type]
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("unbroken")}
        out[module] = deps
    return out


def test_every_module_has_a_layer() -> None:
    missing = sorted({_top(m) for m in imports()} - set(LAYERS))
    assert not missing, f"add these to LAYERS (and docs/architecture.md): {missing}"


def test_dependencies_point_down() -> None:
    wrong = []
    for module, deps in imports().items():
        top = _top(module)
        for dep in deps:
            dtop = _top(dep)
            if dep == "unbroken.__version__":
                continue  # a constant of the package, not the API
            if dtop != top and LAYERS[dtop] > LAYERS[top]:
                wrong.append(f"{module} (layer {LAYERS[top]}) imports {dep} (layer {LAYERS[dtop]})")
    assert not wrong, "\n".join(wrong)


def test_bottom_packages_are_self_contained() -> None:
    wrong = []
    for module, deps in imports().items():
        top = _top(module)
        if top in SELF_CONTAINED:
            allowed = SELF_CONTAINED[top] | {top}
            wrong += [f"{module} imports {d}" for d in deps if _top(d) not in allowed]
    assert not wrong, "\n".join(wrong)


def test_the_rule_catches_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """Negative control: a store module importing the manager is reported."""
    real = imports()
    monkeypatch.setattr(__import__(__name__), "imports",
                        lambda: {**real, "unbroken.store.bad": {"unbroken.manager"}})
    try:
        test_dependencies_point_down()
    except AssertionError as e:
        assert "unbroken.store.bad (layer 0) imports unbroken.manager (layer 4)" in str(e)
    else:
        raise AssertionError("an upward import went unnoticed")
