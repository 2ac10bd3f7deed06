"""The package as users install it (issue 36): ``python -m build`` makes an sdist and a wheel (from a copy of
the tracked files: nothing is written into the checkout), the wheel installs into a fresh virtual environment
with its declared dependencies only, and there ``unbroken --version``, a short save and restore, and
``unbroken plot`` without matplotlib (an extra) behave as documented.

torch itself (700 MB unpacked, 40 s of CPU to install) comes from a folder installed once per machine with the
pins of ``constraints.txt`` (:mod:`buildcache`: rebuilt when they change), which the fresh environment sees
through a ``.pth`` file: pip finds it installed and installs every other dependency the wheel declares."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import buildcache
import unbroken

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent

SAVE_RESTORE = '''
import torch, unbroken
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters())
ckpt = unbroken.Checkpointer("run", save_every=2)
state = {"model": model, "optimizer": opt}
ckpt.restore(state)
for _ in range(4):
    model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    ckpt.step(state)
ckpt.close()
again = {"model": torch.nn.Linear(4, 2), "optimizer": None}
again["optimizer"] = torch.optim.AdamW(again["model"].parameters())
ckpt = unbroken.Checkpointer("run")
ckpt.restore(again)
assert ckpt.progress.step == 4 and torch.equal(again["model"].weight, model.weight)
ckpt.close()
print("restored at", ckpt.progress.step)
'''


def _run(cmd: list[object], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _tracked_copy(dest: Path) -> Path:
    """The checkout's tracked files (the working tree's versions), as a clean clone would have them."""
    names = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def torch_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding torch as ``constraints.txt`` pins it and torch's own dependencies (``pip install
    --target``), made once per machine and pins (see the module docstring), complete or made again."""
    place = buildcache.folder(buildcache.root(tmp_path_factory), "torch-site", buildcache.key("torch-site"))
    place.mkdir(parents=True, exist_ok=True)
    with buildcache.locked(place):
        if not (place / ".key").is_file():  # written last: a half-made folder is made again
            shutil.rmtree(place / "site", ignore_errors=True)
            p = _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                      place / "site", "-c", REPO / "constraints.txt", "torch"], place, timeout=900)
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
            (place / ".key").write_text("torch-site\n")
    return place / "site"


def test_the_wheel_installs_in_a_fresh_environment_and_works_without_matplotlib(tmp_path: Path,
                                                                                 torch_site: Path) -> None:
    src = _tracked_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    p = _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", dist, src], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = dist.glob(f"unbroken-{unbroken.__version__}-py3-none-any.whl")
    (sdist,) = dist.glob(f"unbroken-{unbroken.__version__}.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert "unbroken/py.typed" in names and "unbroken/checkpointer/manager.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names), "the wheel carries the test suite"
    metadata = zipfile.ZipFile(wheel).read(f"unbroken-{unbroken.__version__}.dist-info/METADATA").decode()
    core = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert core and not any("matplotlib" in line for line in core), core  # an extra, not the core
    assert 'Requires-Dist: matplotlib>=3.7; extra == "plot"' in metadata
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    assert f"unbroken-{unbroken.__version__}/README.md" in members
    assert f"unbroken-{unbroken.__version__}/src/unbroken/py.typed" in members

    venv = tmp_path / "venv"
    p = _run([sys.executable, "-m", "venv", venv], tmp_path)
    assert p.returncode == 0, p.stderr
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "torch-site.pth").write_text(f"{torch_site}\n")
    p = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
              "-c", REPO / "constraints.txt", wheel], tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p = _run([venv / "bin" / "unbroken", "--version"], tmp_path)
    assert p.returncode == 0 and unbroken.__version__ in p.stdout, p.stdout + p.stderr
    work = tmp_path / "work"
    work.mkdir()
    p = _run([venv / "bin" / "python", "-c", SAVE_RESTORE], work)
    assert p.returncode == 0 and "restored at 4" in p.stdout, p.stdout + p.stderr[-3000:]
    where = _run([venv / "bin" / "python", "-c", "import unbroken; print(unbroken.__file__)"], tmp_path).stdout
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout
    p = _run([venv / "bin" / "python", "-c", "import matplotlib"], tmp_path)
    assert p.returncode != 0, "matplotlib came with the core install"
    p = _run([venv / "bin" / "unbroken", "plot", "run"], work)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "drawing needs matplotlib" in p.stderr and "pip install -e '.[plot]'" in p.stderr, p.stderr
    assert not list(work.glob("*.png"))
