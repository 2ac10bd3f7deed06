"""Shared fixtures: a real S3 server (SeaweedFS) started once per session, a private cache, and the guard
that fails the session if any test wrote into the repository (:mod:`repo_guard`)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import buildcache
import timeline
from repo_guard import changes, snapshot, tracked
from s3_server import S3Server

REPO = Path(__file__).resolve().parent.parent
REAL_PYTHON = sys.executable
"""The virtual environment's interpreter (``sys.executable`` is the zygote's launcher in some files)."""

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers get COLUMNS=80 and LINES=24 (set for their terminal reporting), which a
    # serial run does not have: the CLI would wrap its piped output at 80 columns there only
    for _var in ("COLUMNS", "LINES"):
        os.environ.pop(_var, None)


MEASURED_S: dict[str, float] = {
    "test_deepspeed.py": 134,
    "test_deepspeed_convert.py": 126,
    "test_multinode.py": 123,
    "test_warm_restart.py": 122,
    "test_async_save.py": 119,
    "test_slurm.py": 106,
    "test_readonly.py": 105,
    "test_llamafactory.py": 102,
    "test_signals_torchrun.py": 100,
    "test_signals_e2e.py": 96,
    "test_selftest.py": 93,
    "4-ranks": 90,
    "test_examples.py": 76,
    "test_distributed.py": 73,
    "test_zygote.py": 65,
    "test_warm_restart_torchrun.py": 85,
    "test_recovery.py": 60,
    "test_s3.py": 58,
    "test_data_e2e.py": 58,
    "test_integration_lightning_dist.py[deepspeed]": 57,
    "test_tiered.py": 53,
    "test_integration_hf_dist.py[zero2]": 51,
    "test_integration_accelerate.py": 51,
    "test_e2e_s3.py": 50,
    "test_integration_hf.py": 45,
    "test_benchmarks_goodput.py": 44,
    "test_preemption_group.py": 44,
    "test_e2e_kill.py": 42,
    "test_integration_lightning_dist.py[ddp]": 41,
    "test_incremental_e2e.py": 41,
    "test_ram_tier.py": 41,
    "test_integration_hf_dist.py[zero3]": 41,
    "test_doc_blocks.py": 38,
    "test_selftest_trust.py": 36,
    "test_ram_writer.py": 35,
    "test_integration_lightning.py": 35,
    "test_ram_auto.py": 34,
    "test_lock.py": 34,
    "test_ram_tier_dist.py": 34,
    "test_emergency_exact.py": 30,
    "test_packaging.py": 29,
    "test_corruption.py": 29,
    "test_never_fresh.py": 27,
    "test_cli_runlog.py": 27,
    "test_upstream_loops.py": 27,
    "test_preemption.py": 26,
    "test_data_hf.py": 25,
    "test_data_torch_orders.py": 24,
    "test_fuzz.py": 24,
    "test_integration_lightning_dist.py[fsdp2]": 22,
    "test_epochs.py": 22,
    "test_reader_tool.py": 20,
    "test_integration_hf_dist.py[ddp]": 20,
}
"""Seconds the tests of each scope (a file, or a group of :data:`timeline.SPLIT_BY` or
:data:`timeline.FOUR_RANKS`, the ``4-ranks`` scope) took in a full ``make test`` (``python
tests/timeline.py <timeline> --table`` prints this table from a run's timeline; docs/testing.md).
Measured 2026-11-30 (tenth session, commit a9b5006, run 18 of docs/testing.md) on the 2-core machine, a
clean clone, the fork server on (tests/zygote.py). The scheduler hands the scopes out longest first; one
not in the table counts :data:`UNMEASURED_S` per test."""
UNMEASURED_S = 2.0


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (make test): a file's tests stay on one worker with its module fixtures, except
    the files of :data:`timeline.SPLIT_BY`, one scope per parameter value; the scopes are handed out
    longest first by :data:`MEASURED_S` (pytest-xdist's own order is by number of tests, which started the
    longest files, few tests each, last; its ``loadgroup`` marks have no effect under pytest 9)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return timeline.scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the first assignment: the queue is complete
                self.ordered = True
                cost = {key: MEASURED_S.get(Path(key).name, UNMEASURED_S * len(tests))
                        for key, tests in self.workqueue.items()}
                for key in sorted(self.workqueue, key=lambda k: -cost[k]):
                    self.workqueue.move_to_end(key)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


TIMELINE = os.environ.get("UNBROKEN_TEST_TIMELINE")
"""A file that each test appends ``worker, start, end, node id`` to (tab-separated, Unix seconds): the
suite's timeline, read by ``tests/timeline.py`` (docs/testing.md)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = time.time()
    yield
    if TIMELINE:
        with open(TIMELINE, "a") as f:  # one short line per write: appends from several workers stay whole
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{start:.2f}\t{time.time():.2f}\t{item.nodeid}\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm"):  # a SLURM cluster is never part of the fast tier
            item.add_marker(pytest.mark.slow)


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


SLOW_COMMANDS = {"torchrun", "srun", "sbatch", "salloc", "deepspeed", "accelerate"}
SLOW_SCRIPTS = re.compile(r"(hf|hf_dist|lightning|lightning_dist|accel|ds)_train\.py|lf_builtelsewhere\.py")


def slow_command(args: Any) -> bool:
    """Whether a command makes a test ``slow``: several ranks (torchrun, ``-m torch.distributed.run``), a
    SLURM job, a network namespace, or the jobs of another framework (HF, Lightning, Accelerate,
    DeepSpeed, LLaMA-Factory: each pays for that framework's imports in every process)."""
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if not words:
        return False
    exe = Path(words[0])
    return (exe.name in SLOW_COMMANDS or "torch.distributed.run" in words
            or (exe.name == "ip" and "netns" in words) or "/llamafactory-" in words[0]
            or any(SLOW_SCRIPTS.fullmatch(Path(w).name) for w in words[1:3]))


@pytest.fixture(autouse=True)
def _tier_checked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier stays fast: a test that starts several ranks (torchrun), SLURM, a network namespace
    or another framework's environment must be marked ``slow`` (``make test`` runs it, ``make test-fast``
    does not); unmarked, it fails at the start of that process, naming the marker. Processes started by
    fixtures of a wider scope (a module's reference run) belong to the tests of that scope and are not
    counted here."""
    if request.node.get_closest_marker("slow"):
        return
    original = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def checked(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> Any:
        if slow_command(args):
            text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            pytest.fail(f"this test starts {text[:200]!r}: mark it slow (pytest.mark.slow; docs/testing.md)",
                        pytrace=False)
        return original(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", checked)


@pytest.fixture(autouse=True)
def _no_process_left_running() -> Iterator[None]:
    """A test ends every process it starts (DataLoader workers, writer processes). An abandoned DataLoader
    iterator shuts its workers down only when it is collected, possibly inside a later test (whose hang
    guard or warning filter it then broke, far from its cause): a test that leaves children is collected
    here, and what its objects raise while being collected is caught here; children still alive are
    stopped. Either fails this test, naming the children and what was raised (docs/testing.md)."""
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    if not left:
        return
    raised: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: raised.append(f"{type(u.exc_value).__name__}: {u.exc_value} ({u.object!r})")
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
    deadline = time.monotonic() + 10  # a worker told to stop may take a moment to exit: it is not left running
    for p in left:
        p.join(max(0.0, deadline - time.monotonic()))
    left = [p for p in left if p.is_alive()]
    for p in left:
        p.terminate()
        p.join(10)
    if left or raised:
        pytest.fail("this test left processes running (stopped now): "
                    + ", ".join(f"{p.name} (pid {p.pid})" for p in left)
                    + ("; its abandoned objects raised while collected: " + "; ".join(raised) if raised else "")
                    + " (a DataLoader iterator kept alive by a raised exception's frame: drop it in a finally)",
                    pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test closes every Checkpointer it opens, or drops it: a Checkpointer still alive after its test
    keeps watching the preemption signals in this worker, and a later test that checks signal handling
    (``test_faults_unit.py``) then fails far from its cause (it did, in CI). Checked once the test is torn
    down (pytest has then dropped the log records that hold exceptions and their frames): dropped ones
    in reference cycles are collected first; one still alive fails the test's teardown."""
    outcome = yield
    if call.when == "setup":
        item.stash[_WATCHERS_BEFORE] = _watcher_ids()
    if call.when != "teardown":
        return
    before = item.stash.get(_WATCHERS_BEFORE, set())
    if not _watcher_ids() - before:
        return
    gc.collect()
    left = _watcher_ids() - before
    report = outcome.get_result()
    if left and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"this test left {len(left)} Checkpointer(s) open and alive (their signal watchers): "
                           "close() them, or drop every reference (a stored exception holds its frames)")


_WATCHERS_BEFORE = pytest.StashKey[set[int]]()


def _watcher_ids() -> set[int]:
    mod = sys.modules.get("unbroken.faults.signals")
    return {id(w) for w in mod._dispatcher.watchers} if mod is not None else set()


ZYGOTE = os.environ.get("UNBROKEN_TEST_ZYGOTE", "1") != "0"
ZYGOTE_MODULES: set[str] = {
    "test_zygote", "test_e2e_kill", "test_async_save", "test_data_e2e", "test_e2e_s3", "test_emergency_exact",
    "test_incremental_e2e", "test_preemption", "test_recovery", "test_never_fresh", "test_no_clobber",
    "test_resumable_eval", "test_convert", "test_cli", "test_cli_diff", "test_cli_maintain", "test_cli_runlog",
    "test_reader_tool", "test_traps", "test_index", "test_malicious", "test_manager_policies",
    "test_tiered", "test_upstream_loops", "test_benchmarks_goodput", "test_benchmarks_incremental",
    "test_distributed", "test_deepspeed_convert", "test_exithooks", "test_s3", "test_slurm",
    "test_integration_hf", "test_integration_hf_builtelsewhere", "test_integration_hf_dist",
    "test_integration_lightning_dist", "test_deepspeed", "test_ram_tier_dist", "test_integration_hf_ddp4",
    "test_integration_lightning_ddp4", "test_ddp_align", "test_integration_accelerate", "test_integration_lightning",
    "test_data_stream", "test_selftest", "test_selftest_trust", "test_signals_exit", "test_ram_tier", "test_examples",
    "test_readonly", "test_lock", "test_boundary", "test_upstream_gpt", "test_doc_blocks", "test_goodput_report",
    "test_auto_interval", "test_multinode", "test_ram_auto",
}
"""The test files whose processes start from the fork server (:mod:`zygote`, docs/testing.md): each was read
for what a forked child does not give (a SIGSTOP of ``proc.pid``, its ``/proc`` read through ``proc.pid``:
:func:`real_pid`; what a process imports: ``test_cli_start.py`` stays out). ``UNBROKEN_TEST_ZYGOTE=0``
starts every process plainly."""


@pytest.fixture(scope="session")
def _zygote_bin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder like the virtual environment's ``bin`` whose ``python`` is the zygote's launcher: the zygote
    is started now (about 3 s of CPU, ``import torch``); until it listens, the launcher starts plain
    interpreters. Its children are signalled directly by ``Popen.send_signal`` (:func:`_zygote_child`)."""
    import random

    import zygote_server

    here = tmp_path_factory.mktemp("zygote")
    sock, pids, bin_dir = here / "sock", here / "pids", here / "bin"
    pids.mkdir()
    bin_dir.mkdir()
    _ZYGOTE_PIDS[:] = [pids]
    real = sys.executable
    launcher = bin_dir / "python"
    for entry in Path(real).parent.iterdir():  # console scripts (unbroken, torchrun) start from the zygote too
        if entry.name == "python":
            continue
        head = entry.read_bytes()[:200] if entry.is_file() and not entry.is_symlink() else b""
        if head.startswith(f"#!{real}\n".encode()):
            (bin_dir / entry.name).write_bytes(f"#!{launcher}".encode() + entry.read_bytes()[len(real) + 2:])
            (bin_dir / entry.name).chmod(0o755)
        else:
            (bin_dir / entry.name).symlink_to(entry)
    launcher.write_text(f"#!{real} -SI\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                        f"import zygote\nzygote.launch({str(sock)!r}, {real!r}, {str(pids)!r})\n")
    launcher.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    env["PYTHONHASHSEED"] = str(random.randrange(1, 2**32 - 1))
    with open(here / "log", "w") as log:
        proc = subprocess.Popen([real, zygote_server.__file__, "--serve", str(sock), str(pids)], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    original = subprocess.Popen.send_signal

    def send_signal(self: subprocess.Popen, sig: int) -> None:
        self.poll()
        child = _zygote_child(pids, self.pid) if self.returncode is None else None
        if child is None:
            return original(self, sig)
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    subprocess.Popen.send_signal = send_signal  # type: ignore[method-assign]
    try:
        yield bin_dir
    finally:
        subprocess.Popen.send_signal = original  # type: ignore[method-assign]
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_ZYGOTE_PIDS: list[Path] = []  # the pids folder of this worker's zygote, once started


def real_pid(proc: subprocess.Popen | int) -> int:
    """The pid of the process ``proc`` (a Popen or a pid) stands for: the zygote's child behind a launcher,
    else ``proc``'s own (for a test that reads the process's ``/proc``)."""
    pid = proc if isinstance(proc, int) else proc.pid
    child = _zygote_child(_ZYGOTE_PIDS[0], pid) if _ZYGOTE_PIDS else None
    return child if child is not None else pid


def _zygote_child(pids: Path, launcher: int) -> int | None:
    """The zygote's child that launcher ``launcher`` stands for (``None``: not a launcher, or its child
    has not started or is gone): its file names it with its start time, checked against ``/proc``."""
    from zygote_child import _start_time
    try:
        child, start = (pids / str(launcher)).read_text().split()
        return int(child) if _start_time(int(child)) == start else None
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _zygote(request: pytest.FixtureRequest) -> Iterator[None]:
    """In the files of :data:`ZYGOTE_MODULES`, ``sys.executable`` is the zygote's launcher."""
    if not ZYGOTE or Path(str(request.node.path)).stem not in ZYGOTE_MODULES:
        yield
        return
    real = sys.executable
    sys.executable = str(request.getfixturevalue("_zygote_bin") / "python")
    try:
        yield
    finally:
        sys.executable = real


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Derived data of remote runs (their index) goes to a temp folder, not ~/.cache."""
    os.environ["UNBROKEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("unbroken-cache"))


@pytest.fixture(scope="session")
def deepspeed_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of the DeepSpeed jobs: its CPU accelerator, and one folder for the C++ op it
    compiles at its first start (about a minute), shared by every DeepSpeed test of the session and by
    every pytest-xdist worker (torch's extension builder locks the build folder, so concurrent first
    starts build once). The folder is keyed by the versions of DeepSpeed, torch and the interpreter
    (:mod:`buildcache`; ``make test`` keeps it between runs): another version builds anew, and a clean
    clone of the same versions reuses the build (:func:`buildcache.restore_ninja_inputs`)."""
    import importlib.metadata

    digest = buildcache.key(*(f"{d}=={importlib.metadata.version(d)}" for d in ("deepspeed", "torch")))
    extensions = buildcache.folder(buildcache.root(tmp_path_factory), "torch-extensions", digest)
    extensions.mkdir(exist_ok=True)
    (extensions / ".key").write_text(digest)
    for lock in extensions.glob("*/lock"):  # torch's build lock, left by a build that was killed: later
        if time.time() - lock.stat().st_mtime > 1800:  # builds would wait on it forever (a build takes ~1 min)
            lock.unlink(missing_ok=True)
    with buildcache.locked(extensions):  # a clean clone's sources are new files with the built bytes
        buildcache.restore_ninja_inputs(extensions)
    yield dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=str(extensions))
    with buildcache.locked(extensions):
        buildcache.record_ninja_inputs(extensions)


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

