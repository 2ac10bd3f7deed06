"""``unbroken run -- python train.py``: restarts after failures from a warm spare, exact, bounded.

End to end with real processes: the training process SIGKILLed at steps and inside a save (once, a
marker), each time replaced by the spare — a process forked, before the failure, from the interpreter that
imported torch (or, with ``UNBROKEN_SPARES_FORK=0``, a new interpreter) — and the final parameters equal the
uninterrupted run's bit for bit. Then what a supervisor must get right: a preemption (SIGTERM to the
supervisor, or to the job's whole process group) is saved and ends the job with 75, no restart; the restarts
are bounded; a command a spare cannot run restarts cold; a spare that cannot import falls back to a cold
start; a supervisor SIGKILLed leaves nothing running, the training saved; the forker SIGKILLed costs restarts,
not exactness.
No timing is asserted; the speed is measured by ``benchmarks/bench_warm_restart.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import alive, children

from unbroken.launch.command import parse

pytestmark = pytest.mark.e2e

LOOP = """
import os, sys, time, hashlib, torch, unbroken
run, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
state = {"model": model, "optimizer": opt}
ckpt = unbroken.Checkpointer(run, save_every=5)
info = ckpt.restore(state)
print(f"pid {os.getpid()} " + (f"resumed from step {ckpt.progress.step}" if info else "fresh start"), flush=True)
with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
    print("parent", "forker" if b"unbroken.launch.forker" in f.read() else "other", flush=True)
while ckpt.progress.step < steps:
    s = ckpt.progress.step + 1
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(s))
    loss = model(x).pow(2).mean()  # dropout: the global RNG, restored with the checkpoint
    loss.backward(); opt.step(); opt.zero_grad()
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.01")))
    ckpt.step(state, loss=loss.item())
    print("step", s, flush=True)
    held = f"{run}.held-{s}"
    if str(s) in os.environ.get("HOLD_AT", "").split(",") and not os.path.exists(held):
        open(held, "w").close()  # the test kills this process here (once: not again after the resume)
        time.sleep(120)
ckpt.close()
h = hashlib.sha256()
for v in [*model.state_dict().values(), *[t for s in opt.state.values() for t in s.values()]]:
    h.update(v.numpy().tobytes())
open(out, "w").write(h.hexdigest())
"""


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_FAULT")}
    return dict(out, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


def supervise(tmp: Path, *options: str, steps: int = 120, environ: dict[str, str] | None = None,
              command: list[str] | None = None, session: bool = False) -> subprocess.Popen[str]:
    """``unbroken run`` of the loop (or ``command``); ``session``: in a session (and process group) of its own."""
    script = tmp / "loop.py"
    script.write_text(LOOP)
    cmd = command or [sys.executable, str(script), str(tmp / "run"), str(steps), str(tmp / "final")]
    return subprocess.Popen([sys.executable, "-m", "unbroken.cli", "run", *options, "--", *cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ or env(), cwd=tmp,
                            start_new_session=session)


def uninterrupted(tmp: Path, steps: int = 120) -> str:
    ref = tmp / "reference"
    ref.mkdir()
    (ref / "loop.py").write_text(LOOP)
    subprocess.run([sys.executable, str(ref / "loop.py"), str(ref / "run"), str(steps), str(ref / "final")],
                   check=True, capture_output=True, env=env(), timeout=300)
    return (ref / "final").read_text()


def drive(proc: subprocess.Popen[str], kills: dict[int, int]) -> list[str]:
    """Read the training's lines; SIGKILL the training process (not the supervisor) once it printed step
    ``s`` and holds there (``HOLD_AT``), for each ``s`` in ``kills``, after waiting until a spare is ready
    (it warms while the training runs: the supervisor waits for it anyway, the test only keeps it honest)."""
    assert proc.stdout is not None
    lines, pid = [], 0
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("pid "):
            pid = int(line.split()[1])
        elif line.startswith("step ") and int(line.split()[1]) in kills:
            kills.pop(int(line.split()[1]))
            wait_for_spare(proc.pid, training=pid)
            os.kill(pid, signal.SIGKILL)
    return lines


def forkers_of(supervisor: int) -> list[int]:
    """The supervisor's spare forker (none with ``UNBROKEN_SPARES_FORK=0``)."""
    return children(supervisor, b"unbroken.launch.forker")


def spares_of(supervisor: int, training: int) -> list[int]:
    """The supervisor's spares that are not the training process (a spare that became it): forked by its forker
    (children of the forker), or started as new interpreters (children of the supervisor naming the spare module)."""
    forked = [pid for forker in forkers_of(supervisor) for pid in children(forker)]
    found = children(supervisor, b"unbroken.launch.spare") + forked
    return [pid for pid in found if pid != training]


def wait_for_spare(supervisor: int, training: int, timeout: float = 120.0) -> None:
    """Until a spare of ``supervisor`` has imported what it preloads (it then blocks reading its pipe: its
    ``wchan`` is a pipe read), bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in spares_of(supervisor, training):
            try:
                if "pipe" in Path(f"/proc/{pid}/wchan").read_text() or _reading(pid):
                    return
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no spare of {supervisor} was ready within {timeout} s")


def _reading(pid: int) -> bool:
    """The process sleeps in a read (``anon_pipe_read``/``pipe_read``; ``wchan`` may be hidden: then its
    stack of syscalls says ``read`` with the go pipe's fd)."""
    try:
        syscall = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return bool(syscall) and syscall[0] == "0"  # read(2) on x86-64


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_killed_at_steps_and_inside_a_save_each_restart_is_warm_and_the_run_is_exact(tmp_path: Path) -> None:
    marker = tmp_path / "fault-fired"
    proc = supervise(tmp_path, environ=env(UNBROKEN_FAULTS="save.mid_file=6", UNBROKEN_FAULT_ONCE=str(marker),
                                           HOLD_AT="40,90"))
    lines = drive(proc, {40: 1, 90: 1})
    assert proc.wait(timeout=300) == 0, proc.stderr.read() if proc.stderr else ""
    err = proc.stderr.read() if proc.stderr else ""
    assert marker.exists()  # the kill inside a save (its 6th file: step 10's) happened
    starts = [line for line in lines if line.startswith("pid ")]
    assert len(starts) == 4 and "fresh start" in starts[0], starts
    assert len({line.split()[1] for line in starts}) == 4  # four processes
    assert err.count("from the warm spare") == 3, err
    assert [line for line in lines if line.startswith("parent ")] == ["parent forker"] * 4  # each one forked
    assert (tmp_path / "final").read_text() == uninterrupted(tmp_path)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked-spares", "new-interpreters"])
def test_a_killed_process_is_replaced_by_the_spare_and_the_run_is_exact(tmp_path: Path, fork: str) -> None:
    proc = supervise(tmp_path, steps=40, environ=env(HOLD_AT="12", UNBROKEN_SPARES_FORK=fork))
    lines = drive(proc, {12: 1})
    assert proc.wait(timeout=300) == 0
    err = proc.stderr.read() if proc.stderr else ""
    assert "restart 1 of 10, from the warm spare" in err, err
    assert [line.split()[2:] for line in lines if line.startswith("pid ")] == [
        ["fresh", "start"], ["resumed", "from", "step", "10"]]
    parent = "forker" if fork == "1" else "other"
    assert [line for line in lines if line.startswith("parent ")] == [f"parent {parent}"] * 2
    assert (tmp_path / "final").read_text() == uninterrupted(tmp_path, steps=40)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_forker_sigkilled_mid_run_costs_restarts_not_steps_and_the_run_is_exact(tmp_path: Path) -> None:
    """The forker SIGKILLed while a forked training runs and a forked spare waits: both run on (neither is its
    child's concern), but their ends are no longer reported: each counts as a failure (``LOST``: 1) and is
    restarted — from the last checkpoint, as any restart —, then spares are new interpreters. Exact all the same."""
    proc = supervise(tmp_path, steps=60, environ=env(STEP_SLEEP="0.05"))
    assert proc.stdout is not None and proc.stderr is not None
    lines, training, killed = [], 0, False
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("pid "):
            training = int(line.split()[1])
        elif line.startswith("step ") and int(line.split()[1]) >= 10 and not killed:
            wait_for_spare(proc.pid, training)
            (forker,) = forkers_of(proc.pid)
            os.kill(forker, signal.SIGKILL)
            killed = True
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    err = proc.stderr.read()
    assert killed and "the spare forker has ended: spares start as new interpreters" in err, err
    parents = [line for line in lines if line.startswith("parent ")]
    assert parents[0] == "parent forker" and parents[-1] == "parent other", parents
    assert (tmp_path / "final").read_text() == uninterrupted(tmp_path, steps=60)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_sigterm_to_the_whole_process_group_saves_and_ends_with_75(tmp_path: Path) -> None:
    """A scheduler signals every process of the job (``kill -TERM -PGID``, SLURM's way): the forker, in the
    job's group, must outlive it to report the training's 75 (it ignores the signal), and the waiting spare
    goes."""
    proc = supervise(tmp_path, steps=10_000, environ=env(STEP_SLEEP="0.02"), session=True)
    assert proc.stdout is not None and proc.stderr is not None
    training = 0
    for line in proc.stdout:
        if line.startswith("pid "):
            training = int(line.split()[1])
        elif line.startswith("step 20"):
            wait_for_spare(proc.pid, training)
            helpers = forkers_of(proc.pid) + spares_of(proc.pid, training)
            threads = len(os.listdir(f"/proc/{helpers[0]}/task"))  # the forker forks single-threaded
            os.killpg(proc.pid, signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 75, proc.stderr.read()
    assert "pid " not in rest and "restart" not in proc.stderr.read()
    assert len(helpers) == 2 and threads == 1, (helpers, threads)  # the forker and a forked spare, gone now
    deadline = time.monotonic() + 30
    while any(alive(p) for p in (training, *helpers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in (training, *helpers))


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_preemption_saves_and_ends_with_75_without_a_restart(tmp_path: Path) -> None:
    proc = supervise(tmp_path, steps=10_000, environ=env(STEP_SLEEP="0.02"))
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 20"):
            proc.send_signal(signal.SIGTERM)  # the scheduler's: to the supervisor, forwarded
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 75
    assert "pid " not in rest  # no second training process
    assert proc.stderr is not None and "restart" not in proc.stderr.read()


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_restarts_are_bounded_and_the_status_is_the_trainings(tmp_path: Path) -> None:
    crash = tmp_path / "crash.py"
    crash.write_text("import sys, torch\nprint('pid started', flush=True)\nsys.exit(3)\n")
    proc = supervise(tmp_path, "--max-restarts", "2", command=[sys.executable, str(crash)])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3 and out.count("pid started") == 3, (out, err)
    assert "2 restarts used up: stopping" in err and err.count("from the warm spare") == 2


def test_a_command_that_is_not_python_restarts_cold(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "--max-restarts", "1", command=["sh", "-c", "echo ran; exit 4"])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4 and out.count("ran") == 2
    assert "cold restarts: 'sh' is not a Python interpreter" in err and "spare" not in err.split("cold")[-1]


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_spare_that_cannot_import_falls_back_to_a_cold_start(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "--preload", "no_such_module_here", steps=5)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "fresh start" in out, err
    assert "the spare was not ready (failed ModuleNotFoundError" in err and "starting cold" in err


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_supervisor_sigkilled_leaves_nothing_running_the_training_saves_and_the_run_goes_on(tmp_path: Path) -> None:
    """SIGKILL to ``unbroken run`` itself: it can forward nothing. The training process (forked: its parent is the
    forker) is signalled as a preempted one (its launcher died: a thread on the supervisor's pidfd): it saves at
    its next step and exits, its lock released; the waiting spare exits (its pipe closed), the forker too (its
    socket closed). A new ``unbroken run`` resumes from that save."""
    proc = supervise(tmp_path, steps=10_000, environ=env(STEP_SLEEP="0.05"))
    assert proc.stdout is not None and proc.stderr is not None
    training, seen = 0, 0
    for line in proc.stdout:
        if line.startswith("pid "):
            training = int(line.split()[1])
        elif line.startswith("step ") and int(line.split()[1]) >= 3:
            seen = int(line.split()[1])
            break
    forker = 0
    try:
        wait_for_spare(proc.pid, training)
        spare = spares_of(proc.pid, training)[0]
        (forker,) = forkers_of(proc.pid)
        proc.kill()  # SIGKILL: no clean-up in the supervisor
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while (alive(spare) or alive(training) or alive(forker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = {"the spare": alive(spare), "the training": alive(training), "the forker": alive(forker)}
    finally:
        for pid in (training, forker, *spares_of(proc.pid, training)):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)
    rest, err = proc.stdout.read(), proc.stderr.read()  # to their end: every writer is gone
    assert not any(survivors.values()), f"outlived the supervisor: {survivors}"
    last = max([seen] + [int(x.split()[1]) for x in rest.splitlines() if x.startswith("step ")])
    assert "the launcher died" in err and "exiting with 75" in err, err[-3000:]
    again = supervise(tmp_path, steps=last + 3)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    resumed = re.search(r"resumed from step (\d+)", out)  # the step it stopped at was saved, the lock freed
    assert resumed and last <= int(resumed.group(1)) <= last + 1, (out, err)  # (that step's line: not printed)


@pytest.mark.parametrize("argv,warm,what", [
    (["python3", "train.py", "--lr", "3"], True, ("train.py", ["--lr", "3"])),
    (["python3", "-u", "-X", "dev", "-m", "pkg.train", "a"], True, ("pkg.train", ["a"])),
    (["python3", "-c", "print(1)"], False, None),
    (["sh", "-c", "true"], False, None),
])
def test_which_commands_a_spare_can_become(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                           warm: bool, what: tuple[str, list[str]] | None) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    cmd = parse(argv)
    assert cmd.warm == warm, cmd.cold
    if what is not None:
        assert (cmd.script or cmd.module, cmd.args) == what


CUDA_PROBE = """
import json, os, sys, torch
print("probe", json.dumps({"initialized_at_start": torch.cuda.is_initialized(), "pid": os.getpid()}), flush=True)
x = torch.ones(1, device="cuda")  # the training process uses the GPU: it may create its context now
print("probe", json.dumps({"initialized_after": torch.cuda.is_initialized()}), flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def _gpu_processes() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60)
    return {int(x) for x in out.stdout.split() if x.strip().isdigit()}


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_waiting_spare_holds_no_cuda_context(tmp_path: Path) -> None:
    """The CUDA side of the warm restart: a spare imports torch but creates no CUDA context (no GPU memory
    while it waits: it is not among the GPU's processes), and the process it becomes starts without one."""
    probe = tmp_path / "probe.py"
    probe.write_text(CUDA_PROBE)
    proc = subprocess.Popen([sys.executable, "-m", "unbroken.cli", "run", "--max-restarts", "1", "--",
                             sys.executable, str(probe)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(EXIT="1"))
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("probe") and "initialized_after" in line and len(lines) <= 2:
            training = int(json.loads(lines[0].split(" ", 1)[1])["pid"])
            wait_for_spare(proc.pid, training)
            spares = set(spares_of(proc.pid, training))
            assert spares and not spares & _gpu_processes()  # the waiting spare is not on the GPU
    assert proc.wait(timeout=300) == 1
    starts = [json.loads(x.split(" ", 1)[1]) for x in lines if "initialized_at_start" in x]
    assert len(starts) == 2 and not any(s["initialized_at_start"] for s in starts)
