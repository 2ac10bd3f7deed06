"""Shared fixtures: a real S3 server (SeaweedFS) started once per session, a private cache, and the guard
that fails the session if any test wrote into the repository (:mod:`repo_guard`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from repo_guard import changes, snapshot, tracked  # noqa: E402
from s3_server import S3Server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers get COLUMNS=80 and LINES=24 (set for their terminal reporting), which a
    # serial run does not have: the CLI would wrap its piped output at 80 columns there only
    for _var in ("COLUMNS", "LINES"):
        os.environ.pop(_var, None)


LONGEST_FIRST = (
    "test_integration_hf_dist.py", "test_llamafactory.py", "test_integration_lightning_dist.py",
    "test_distributed.py", "test_selftest.py", "test_upstream_loops.py", "test_data_e2e.py", "test_integration_hf.py",
    "test_incremental_e2e.py",
    "test_integration_lightning.py", "test_examples.py", "test_deepspeed.py", "test_async_save.py",
    "test_deepspeed_alone.py", "test_preemption.py", "test_e2e_kill.py", "test_recovery.py", "test_ram_tier.py",
    "test_integration_accelerate.py", "test_benchmarks_goodput.py",
    "test_readonly.py", "test_lock.py", "test_accelerate_alone.py", "test_multinode.py", "test_e2e_s3.py",
    "test_deepspeed_convert.py", "test_never_fresh.py", "test_s3.py", "test_boundary.py", "test_emergency_exact.py",
    "test_selftest_trust.py", "test_epochs.py",
)
"""Test files that take longest, longest first (measured; the README's "Tests" has the suite's
timings). ``make test`` runs the files in parallel (pytest-xdist, ``--dist loadfile``: one file's tests
and module fixtures stay on one worker); starting the long ones first keeps one of them from
starting last and running alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope="session")
def _repository_unchanged(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests write only inside their tmp_path: the repository (ignored folders included, tool caches
    excluded) must look the same after the session as before it; otherwise the session fails, naming
    each path (the last test gets the error; run the suspects alone to find the writer)."""
    basetemp = tmp_path_factory.getbasetemp()
    before = snapshot(REPO, skip=basetemp)
    yield
    found = changes(before, snapshot(REPO, skip=basetemp), tracked(REPO), REPO)
    if found:
        pytest.fail("tests changed the repository (a test must write only inside its tmp_path):\n  "
                    + "\n  ".join(found[:50]) + (f"\n  ... {len(found) - 50} more" if len(found) > 50 else ""),
                    pytrace=False)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("2m")``: a real tmpfs of that size mounted in the test's folder (a full filesystem, a
    small /dev/shm), unmounted after the test. Mounting needs root: without it the test is skipped;
    as root (CI) a failed mount fails the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if res.returncode != 0:
            why = f"cannot mount a tmpfs: {res.stderr.decode().strip()}"
            if os.geteuid() == 0:
                pytest.fail(why)
            pytest.skip(why + " (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(autouse=True)
def _signal_dispositions_restored() -> Iterator[None]:
    """A test that leaves a signal ignored in this process is undone: Lightning sets
    SIGINT to "ignore" for good when a fit is interrupted, and every process a later test of the
    same worker starts would inherit that (a Ctrl-C test then fails far from its cause)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in before.items():  # only an "ignore" left behind: handlers a fixture keeps are its own
        if signal.getsignal(s) == signal.SIG_IGN and handler not in (None, signal.SIG_IGN):
            signal.signal(s, handler)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Derived data of remote runs (their index) goes to a temp folder, not ~/.cache."""
    os.environ["UNBROKEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("unbroken-cache"))


@pytest.fixture(scope="session")
def deepspeed_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of the DeepSpeed jobs: its CPU accelerator, and one folder for the C++ op it
    compiles at its first start (about a minute), shared by every DeepSpeed test of the session —
    and by every pytest-xdist worker of it (the folder is in the run's common temp root; torch's
    extension builder locks the build folder, so concurrent first starts build once)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # .../pytest-N/popen-gwK -> .../pytest-N, common to the workers
    extensions = root / "torch-extensions"
    extensions.mkdir(exist_ok=True)
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                TORCH_EXTENSIONS_DIR=str(extensions))


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    """One SeaweedFS server for the session (fresh folder, explicit ports, stopped at the end)."""
    server = S3Server()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture()
def s3(s3_server: S3Server) -> S3Server:
    """The session's S3 server, running (a test may have killed it: it is restarted)."""
    if s3_server.proc is None or s3_server.proc.poll() is not None:
        s3_server.proc = None
        s3_server.start()
    return s3_server


@pytest.fixture()
def s3_url(s3: S3Server) -> str:
    """A run location in a fresh bucket of the test S3 server."""
    return f"s3://{s3.new_prefix()}/run"

