"""Which zygote a script's launch goes to: the framework imports it runs first thing (the whole: :mod:`zygote`)."""

from __future__ import annotations

import os

from zygote import FRAMEWORKS, framework_env, parse


def flavour(req: dict, imported: set[str]) -> tuple | None:
    """Which framework zygote a script's launch goes to: ``(statements, environment)``, the statements
    that import a framework (:data:`zygote.FRAMEWORKS`) that the script runs first thing, and the variables
    those frameworks read at import (:func:`zygote.framework_env`), or ``None``. The script's statements
    are read from its start while they can run in the zygote without changing what the script would
    see: a docstring, the imports of modules already imported (the standard library, torch), the
    frameworks' imports, and ``os.environ.setdefault(name, value)`` of a variable already set. At the
    first other statement the reading stops, so the frameworks are imported in the script's order, and
    before anything of its own."""
    import ast
    kind, what, _, _ = parse(req["args"])  # type: ignore[misc]
    path = os.path.join(req["cwd"], what)
    if kind != "script" or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(1 << 20))
    except (OSError, SyntaxError, ValueError):
        return None
    statements: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Expr) and _is_setdefault(node.value, req["env"]):
            continue
        if isinstance(node, ast.If) and not node.orelse and _environ_test(node.test, req["env"]) is False:
            continue  # an ``if`` on the environment that does nothing in this one
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = {node.module.split(".")[0]}
        elif isinstance(node, ast.Import):
            tops = {a.name.split(".")[0] for a in node.names}
        elif _optional_imports(node):  # try: import lightning ... except ImportError: lightning = None
            tops = {n for stmt in node.body for n in _tops(stmt)}  # type: ignore[attr-defined]
        else:
            break
        if tops <= FRAMEWORKS:
            statements.append(ast.unparse(node))
        elif not tops <= imported | {"__future__"}:
            break
    if not statements:
        return None
    env = tuple(sorted((k, v) for k, v in req["env"].items() if framework_env(k)))
    return tuple(statements), env


def _tops(node: object) -> set[str]:
    import ast
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    return set()


def _optional_imports(node: object) -> bool:
    """``try:`` of framework imports only, ``except ImportError:`` (or ``ModuleNotFoundError``) of plain
    assignments: run whole in the zygote (the imports succeed there, or the names get their fallback)."""
    import ast
    return (isinstance(node, ast.Try) and not node.orelse and not node.finalbody and bool(node.body)
            and all(isinstance(b, (ast.Import, ast.ImportFrom)) and _tops(b) and _tops(b) <= FRAMEWORKS
                    for b in node.body)
            and all(h.type is not None and ast.unparse(h.type) in ("ImportError", "ModuleNotFoundError")
                    and all(isinstance(b, ast.Assign) for b in h.body) for h in node.handlers))


def _environ_test(test: object, env: dict) -> bool | None:
    """The value of a condition made only of ``"NAME" in os.environ`` (``not in``), ``not``, ``and``,
    ``or``, in ``env``; ``None`` for any other condition."""
    import ast
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.In, ast.NotIn)) \
            and isinstance(test.left, ast.Constant) and ast.unparse(test.comparators[0]) == "os.environ":
        return (test.left.value in env) == isinstance(test.ops[0], ast.In)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _environ_test(test.operand, env)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [_environ_test(v, env) for v in test.values]
        if None in values:
            return None
        return all(values) if isinstance(test.op, ast.And) else any(values)
    return None


def _is_setdefault(call: object, env: dict) -> bool:
    import ast
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "setdefault"
            and ast.unparse(call.func.value) == "os.environ" and len(call.args) == 2
            and isinstance(call.args[0], ast.Constant) and call.args[0].value in env)
