"""The command line starts without torch: ``--help``, ``--version``, every command's ``--help`` and the
commands that read no tensor (``ls``, ``events``, ``metrics``, ``plot``, ``prune --dry-run``) never
import it; the ones that read tensors (``verify``, ``diff``, ``inspect``) do, when they run.

Checked where it happens: a fresh interpreter runs the commands one after another through the
``unbroken`` entry point and records, after each, whether ``torch`` is in ``sys.modules``; and the
same commands run in a virtualenv that has no torch at all (where ``verify`` says it needs torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from test_cli import train

import unbroken

SRC = Path(unbroken.__file__).resolve().parents[1]
"""Where the ``unbroken`` under test is imported from (the torch-less virtualenv gets it on its path)."""
PROBE = """
import json, sys
plan, out, purelib = sys.argv[1:4]
from unbroken.cli import main
results = []
for argv in json.loads(plan):
    sys.argv = ["unbroken", *argv]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    results.append({"argv": argv, "code": code, "torch": "torch" in sys.modules})
files = sorted({m.__file__ for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(purelib)})
with open(out, "w") as f:
    json.dump({"results": results, "files": files}, f)
"""  # noqa: E501 - the script's text, as it runs


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[str]], list[list[str]]]:
    """``(torch-free commands, commands that read tensors)`` on a run resumed once (re-running 2 steps)."""
    base = tmp_path_factory.mktemp("start")
    run = base / "run"
    train(run, 4)
    train(run, 6, resume_from=run / "step-000000002")
    r, ckpt = str(run), str(run / "step-000000006")
    light = [["--help"], ["--version"], *([c, "--help"] for c in ("ls", "verify", "inspect", "diff", "prune", "tag",
                                                                   "events", "metrics", "plot", "import", "export",
                                                                   "selftest", "demo")),
             ["ls", r], ["ls", r, "--json"], ["events", r], ["metrics", r, "loss"], ["metrics", r, "loss", "--check"],
             ["plot", r, "-o", str(base / "loss.png")], ["prune", r, "--keep-last", "1", "--dry-run"]]
    heavy = [["verify", r], ["diff", ckpt, str(run / "step-000000004")], ["inspect", ckpt]]
    return light, heavy


def probe(python: str, argvs: list[list[str]], tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = tmp_path / "probe.json"
    purelib = sysconfig.get_paths()["purelib"]
    res = subprocess.run([python, "-c", PROBE, json.dumps(argvs), str(out), purelib], capture_output=True, text=True,
                         timeout=300, env=env or {**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.exists(), res.stderr[-3000:]
    return {**json.loads(out.read_text()), "stdout": res.stdout, "stderr": res.stderr}


def test_commands_that_read_no_tensor_never_import_torch(commands, tmp_path: Path) -> None:
    light, heavy = commands
    found = probe(sys.executable, [*light, *heavy], tmp_path)
    results = found["results"]
    assert [(r["argv"], r["code"]) for r in results] == [(a, 0) for a in light] + \
        [(heavy[0], 0), (heavy[1], 1), (heavy[2], 0)], found["stderr"][-3000:]  # diff: two steps differ
    assert [r["argv"] for r in results if r["torch"]] == heavy  # torch only once a command reads tensors


@pytest.fixture(scope="module")
def torchless_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh virtualenv without torch, with links to the packages the torch-free commands import
    here (typer, rich, numpy, xxhash, matplotlib, ...)."""
    venv = tmp_path_factory.mktemp("notorch") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return str(venv / "bin" / "python")


def test_the_torch_free_commands_run_where_torch_is_not_installed(commands, torchless_python: str,
                                                                  tmp_path: Path) -> None:
    light, heavy = commands
    ours = Path(sysconfig.get_paths()["purelib"])
    used = probe(sys.executable, light, tmp_path)["files"]  # what those commands import from site-packages
    site = Path(subprocess.run([torchless_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    tops = {Path(f).relative_to(ours).parts[0] for f in used}
    assert not {t for t in tops if t.split(".")[0] == "torch"}
    for top in tops | {p.name for p in ours.glob("*.libs") if p.name.split(".")[0] in {t.split(".")[0] for t in tops}}:
        os.symlink(ours / top, site / top)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME",)}
    env.update(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    assert subprocess.run([torchless_python, "-c", "import torch"], capture_output=True, env=env).returncode != 0
    found = probe(torchless_python, [*light, ["verify", heavy[0][1]]], tmp_path, env)
    codes = [(r["argv"], r["code"]) for r in found["results"]]
    assert codes == [(a, 0) for a in light] + [(["verify", heavy[0][1]], 1)], found["stderr"][-3000:]
    assert "unbroken verify needs torch (it reads tensors), which is not installed here" in found["stderr"]
    assert '"name": "step-000000006"' in found["stdout"]
    assert "loss: 2 re-run steps compared, 0 differ" in found["stdout"]
