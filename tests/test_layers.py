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
    # one layer per folder (docs/architecture.md); the root holds the public surface
    # 0: foundations, each package self-contained
    "errors": 0, "events": 0, "policies": 0, "_support": 0, "state": 0, "format": 0, "store": 0, "data": 0,
    # 1: one checkpoint's bytes; ranks
    "checkpoint": 1, "dist": 1,
    # 2: the single-checkpoint API; other tiers
    "api": 2, "tiers": 2,
    # 3: a run folder over time; faults and recovery; selftest
    "run": 3, "faults": 3, "selftest": 3,
    # 4: the training side: what each Checkpointer call does
    "checkpointer": 4,
    # 5: the package's names, and thin tools
    "": 5, "cli": 5, "convert": 5, "integrations": 5, "demo": 5, "launch": 5,
}
SELF_CONTAINED = {"store": {"errors", "_support.exithooks"}, "format": {"errors"}, "state": {"errors"}, "data": set()}


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
            wrong += [f"{module} imports {d}" for d in deps
                      if not any(d.split(".", 1)[-1] == a or d.split(".", 1)[-1].startswith(a + ".") for a in allowed)]
    assert not wrong, "\n".join(wrong)


def test_the_rule_catches_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """Negative control: a store module importing the manager is reported."""
    real = imports()
    monkeypatch.setattr(__import__(__name__), "imports",
                        lambda: {**real, "unbroken.store.bad": {"unbroken.checkpointer.manager"}})
    try:
        test_dependencies_point_down()
    except AssertionError as e:
        assert "unbroken.store.bad (layer 0) imports unbroken.checkpointer.manager (layer 4)" in str(e)
    else:
        raise AssertionError("an upward import went unnoticed")


def test_the_rule_catches_a_store_module_using_more_than_its_exit_hooks(monkeypatch) -> None:
    """Negative control: ``store/`` may use ``_support.exithooks``, not the rest of ``_support``."""
    real = imports()
    monkeypatch.setattr(__import__(__name__), "imports",
                        lambda: {**real, "unbroken.store.bad": {"unbroken._support.console",
                                                                "unbroken._support.exithooks"}})
    try:
        test_bottom_packages_are_self_contained()
    except AssertionError as e:
        assert str(e).splitlines()[0] == "unbroken.store.bad imports unbroken._support.console"
    else:
        raise AssertionError("a store module reaching into _support went unnoticed")
