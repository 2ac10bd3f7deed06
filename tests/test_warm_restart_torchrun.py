"""Warm restarts of torchrun's workers: ``torchrun ... -m unbroken.launch.worker train.py``.

End to end with a real torchrun (2 ranks, gloo, CPU): one rank's training process SIGKILLed while it holds
at a step, torchrun restarts both workers, both start from warm spares of the node's spare server, and the
final parameters equal an uninterrupted (cold, plain torchrun) run's bit for bit. Then the worker alone
(started by the test, its "agent"): a changed environment variable gives a cold exec with the reason, a
per-launch one does not, the training's exit status is the worker's; a socket folder owned by another uid or a
symbolic link is refused (cold); the training dies with its worker. No timing is asserted
(``benchmarks/bench_warm_restart_torchrun.py`` measures it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import alive

from unbroken.launch.worker import status

pytestmark = pytest.mark.e2e

TRAIN = """
import hashlib, os, sys, time, torch, unbroken, unbroken.data
import torch.distributed as dist
import torch.nn.functional as F
run, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
unbroken.init_distributed("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x = torch.randn(256, 16, generator=g)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())
loader = unbroken.data.ResumableLoader(data, batch_size=8, shuffle=True, seed=3)
state = {"model": model, "optimizer": opt, "data": loader}
ckpt = unbroken.Checkpointer(run, save_every=5)
info = ckpt.restore(state)
print(f"rank {rank} pid {os.getpid()} t {time.time():.6f} "
      + (f"resumed from step {ckpt.progress.step}" if info else "fresh start"), flush=True)
batches = iter(loader)
while ckpt.progress.step < steps:
    try:
        xb, yb = next(batches)
    except StopIteration:
        batches = iter(loader)
        xb, yb = next(batches)
    loss = F.cross_entropy(model(xb), yb)
    loss.backward(); opt.step(); opt.zero_grad()
    ckpt.step(state, loss=loss.detach())
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    s = ckpt.progress.step
    print(f"rank {rank} step {s}", flush=True)
    held = f"{run}.held-{s}"
    if rank == 1 and str(s) in os.environ.get("HOLD_AT", "").split(",") and not os.path.exists(held):
        open(held, "w").close()  # the test kills this process here (once: not again after the resume)
        time.sleep(120)
ckpt.close()
if rank == 0:
    h = hashlib.sha256()
    for v in [*model.state_dict().values(), *[t for s in opt.state.values() for t in s.values()]]:
        h.update(v.numpy().tobytes())
    open(out, "w").write(h.hexdigest())
dist.destroy_process_group()
"""


START = re.compile(r"rank (\d) pid (\d+) t ([\d.]+) (resumed|fresh)")
STEP1 = re.compile(r"rank 1 step (\d+)")


def env(tmp: Path, **extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_FAULT", "TORCHELASTIC_"))}
    return dict(out, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", UNBROKEN_SPARES_DIR=str(tmp / "spares"),
                UNBROKEN_SPARES_IDLE_S="30", **extra)


def torchrun(*args: str, restarts: int = 3) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            f"--max-restarts={restarts}", *args]


def server_folders(tmp: Path) -> list[Path]:
    base = tmp / "spares"
    return sorted(base.iterdir()) if base.is_dir() else []


def wait_ready(tmp: Path, n: int, timeout: float = 180.0) -> None:
    """Until the (one) server under ``tmp`` has ``n`` spares ready, bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for folder in server_folders(tmp):
            state = status(str(folder))
            if state is not None and state["ready"] >= n:
                return
        time.sleep(0.1)
    raise AssertionError(f"no {n} spares ready within {timeout} s")


def stop_servers(tmp: Path) -> None:
    for folder in server_folders(tmp):
        try:
            os.kill(int((folder / "pid").read_text()), signal.SIGKILL)  # its spares exit: their socket closes
        except (OSError, ValueError):
            pass


def train(tmp: Path, name: str, cmd_prefix: list[str], steps: int, environ: dict[str, str],
          kill_at: int | None = None) -> tuple[int, list[str], list[float]]:
    """Run the 2-rank job; SIGKILL rank 1's training once it holds at step ``kill_at`` (after the spares that
    replace it are ready). Returns the exit status, the output's lines and [kill time, resume times...]."""
    folder = tmp / name
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    proc = subprocess.Popen([*cmd_prefix, "train.py", str(folder / "run"), str(steps), str(folder / "final")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ, cwd=folder)
    assert proc.stdout is not None
    lines: list[str] = []
    pids: dict[int, int] = {}
    times: list[float] = []
    try:
        for line in proc.stdout:  # two ranks print at once (``-u``: a line and its newline are two writes)
            lines.append(line.rstrip())
            for rank, pid, t, how in START.findall(line):
                pids[int(rank)] = int(pid)
                if how == "resumed":
                    times.append(float(t))
            if kill_at is not None and not times and str(kill_at) in STEP1.findall(line):
                while not (folder / f"run.held-{kill_at}").exists():
                    time.sleep(0.01)
                if "-m" in cmd_prefix and "unbroken.launch.worker" in cmd_prefix:
                    wait_ready(tmp, 2)
                times.append(time.time())
                os.kill(pids[1], signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode, lines, times


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_killed_rank_restarts_both_workers_from_warm_spares_and_the_run_is_exact(tmp_path: Path) -> None:
    try:
        code, lines, times = train(tmp_path, "warm", torchrun("-m", "unbroken.launch.worker"), 30,
                                   env(tmp_path, HOLD_AT="12"), kill_at=12)
        out = "\n".join(lines)
        assert code == 0, out
        assert out.count("warm start: the spare") == 4, out  # both workers, both rounds
        assert "cold start" not in out, out
        assert sorted(r for r, _, _, how in START.findall(out) if how == "resumed") == ["0", "1"], out
        assert out.count("resumed from step 10") == 2, out
        assert len(times) == 3  # the kill, then both ranks restored
        ref_code, ref_lines, _ = train(tmp_path, "reference", torchrun(), 30, env(tmp_path))
        assert ref_code == 0, "\n".join(ref_lines)
        assert (tmp_path / "warm" / "final").read_text() == (tmp_path / "reference" / "final").read_text()
    finally:
        stop_servers(tmp_path)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_sigkilled_agent_makes_the_warm_trainings_save_and_exit(tmp_path: Path) -> None:
    """The launcher of a warm training is torchrun's agent (the worker's parent), not the spare server: its
    death is noticed (``unbroken.faults.launcher``), every rank saves the same step and exits; the server ends."""
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    proc = subprocess.Popen([*torchrun("-m", "unbroken.launch.worker"), "train.py", str(folder / "run"), "100000",
                             str(folder / "final")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(tmp_path, STEP_SLEEP="0.05"), cwd=folder)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:  # ends when every writer (the trainings, the workers) has closed it
            lines.append(line.rstrip())
            if line.startswith("rank 1 step 8"):
                server = int((server_folders(tmp_path)[0] / "pid").read_text())
                proc.kill()  # the agent, SIGKILLed: it can neither stop nor signal its workers
                proc.wait(timeout=30)
        out = "\n".join(lines)
        assert sum("SIGTERM received (the launcher died)" in line for line in lines) >= 2, out
        # both ranks, the same step, saved: a preemption's save, or the scheduled save it fell on (logged as one;
        # run 22 of docs/testing.md: the signal noticed in step 9, the save at step 10, a multiple of save_every)
        preempted = re.findall(r"preempted at step (\d+)", out)
        assert len(preempted) == 2 and len(set(preempted)) == 1, out
        assert f"saved step {preempted[0]} to " in out, out
        deadline = time.monotonic() + 30
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server), "the spare server outlived its agent"
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_servers(tmp_path)


def worker(tmp: Path, script: str, environ: dict[str, str], *args: str) -> subprocess.Popen[str]:
    (tmp / "job.py").write_text(script)
    return subprocess.Popen([sys.executable, "-u", "-m", "unbroken.launch.worker", "job.py", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ, cwd=tmp)


JOB = ("import os, sys\nprint('ran', os.getpid(), os.environ.get('FOO'), os.environ['RANK'], sys.argv[1:], flush=True)"
       "\nsys.exit(7)\n")


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_changed_variable_gives_a_cold_exec_and_a_per_launch_one_does_not(tmp_path: Path) -> None:
    base = env(tmp_path, TORCHELASTIC_RUN_ID="job-1", LOCAL_WORLD_SIZE="1", RANK="0")
    try:
        first = worker(tmp_path, JOB, base, "a")
        out, err = first.communicate(timeout=240)
        assert first.returncode == 7 and "warm start" in err and "ran" in out and "['a']" in out, (out, err)
        assert out.split()[1] != str(first.pid)  # the spare ran it, not the worker
        wait_ready(tmp_path, 1)
        other_rank = worker(tmp_path, JOB, dict(base, RANK="3", TORCHELASTIC_RESTART_COUNT="1"), "b")
        out, err = other_rank.communicate(timeout=240)
        assert other_rank.returncode == 7 and "warm start" in err and " 3 ['b']" in out, (out, err)
        changed = worker(tmp_path, JOB, dict(base, FOO="bar"), "c")
        out, err = changed.communicate(timeout=60)
        assert changed.returncode == 7 and f"ran {changed.pid} bar" in out, (out, err)  # exec'd: the same pid
        assert "cold start: the environment differs from the spares' in FOO" in err, err
        assert err.count("cold start") == 1, err
    finally:
        stop_servers(tmp_path)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 1:].split()[1])


PARENT_JOB = """
import os, sys, time
print('ran', os.getpid(), os.getppid(), flush=True)
while sys.argv[1:] == ['wait'] and not os.path.exists('go-on'):
    time.sleep(0.02)
sys.exit(7)
"""


SIGNALLED_JOB = """
import os, signal, sys
sig = getattr(signal, sys.argv[1])
signal.signal(signal.SIGTERM, signal.SIG_DFL)
os.kill(os.getpid(), sig)
"""


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_training_killed_by_a_signal_ends_its_worker_by_the_same_signal(tmp_path: Path) -> None:
    """torchrun sees the worker end as the training did: SIGKILL (whose handling cannot be set: run 24's bench
    found the worker raising there instead) and SIGTERM."""
    base = env(tmp_path, TORCHELASTIC_RUN_ID="job-4", LOCAL_WORLD_SIZE="1", RANK="0")
    try:
        for name in ("SIGKILL", "SIGTERM"):
            proc = worker(tmp_path, SIGNALLED_JOB, base, name)
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == -getattr(signal, name) and "warm start" in err, (name, out, err)
            assert "Traceback" not in err, err
            wait_ready(tmp_path, 1)
    finally:
        stop_servers(tmp_path)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_spares_are_forked_from_one_interpreter_and_a_stopped_forker_costs_one_cold_start(tmp_path: Path) -> None:
    """The server's spares are forked by its forker (one single-threaded interpreter that imported torch), the
    training's exit status comes back through it. A forker that stops answering (SIGSTOP): a launch waits a
    bounded time for its fork, then starts cold; the status of a training it forked is read all the same; the next
    spares are new interpreters (the training's parent: the server)."""
    base = env(tmp_path, TORCHELASTIC_RUN_ID="job-3", LOCAL_WORLD_SIZE="1", RANK="0")
    forker = 0
    try:
        first = worker(tmp_path, PARENT_JOB, base)
        out, err = first.communicate(timeout=240)
        assert first.returncode == 7 and "warm start" in err, (out, err)
        wait_ready(tmp_path, 1)
        folder = server_folders(tmp_path)[0]
        state = status(str(folder))
        assert state is not None
        server, spare = int(state["pid"]), int(state["spares"][0])
        forker = parent_of(spare)
        assert out.split()[2] == str(forker)  # the training was forked too
        assert forker != server and parent_of(forker) == server
        assert "unbroken.launch.forker" in Path(f"/proc/{forker}/cmdline").read_text()
        assert len(os.listdir(f"/proc/{forker}/task")) == 1  # one thread: safe to fork
        os.kill(forker, signal.SIGSTOP)
        second = worker(tmp_path, PARENT_JOB, base, "wait")  # the ready spare; its replacement is never forked
        assert second.stdout is not None
        line = second.stdout.readline()
        assert line.split()[2] == str(forker), line
        third = worker(tmp_path, PARENT_JOB, base)  # waits for the unanswered fork (bounded), then starts cold
        out, err = third.communicate(timeout=240)
        assert third.returncode == 7 and "cold start: no spare became ready" in err, (out, err)
        (tmp_path / "go-on").touch()
        out, err = second.communicate(timeout=240)
        assert second.returncode == 7 and "warm start" in err, (out, err)  # its status, read from its zombie
        wait_ready(tmp_path, 1)
        fourth = worker(tmp_path, PARENT_JOB, base)
        out, err = fourth.communicate(timeout=240)
        assert fourth.returncode == 7 and "warm start" in err and out.split()[2] == str(server), (out, err)
        assert "the spare forker does not answer" in (folder / "log").read_text()
    finally:
        if forker:
            try:
                os.kill(forker, signal.SIGKILL)
            except OSError:
                pass
        stop_servers(tmp_path)


CUDA_JOB = """
import json, os, torch
print(json.dumps({"at_start": torch.cuda.is_initialized()}), flush=True)
torch.ones(1, device="cuda").sum().item()  # the training uses the GPU: its context is created now
print(json.dumps({"after": torch.cuda.is_initialized()}), flush=True)
"""


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_forker_and_its_spares_hold_no_cuda_context(tmp_path: Path) -> None:
    """The CUDA side of forked spares: the forker imports torch and never touches CUDA, so a spare forked after a
    training used the GPU starts without a context and can create one (a fork of a process with a CUDA context
    could not), and neither the forker nor a waiting spare is among the GPU's processes."""
    base = env(tmp_path, TORCHELASTIC_RUN_ID="job-5", LOCAL_WORLD_SIZE="1", RANK="0")
    try:
        for _ in range(2):
            proc = worker(tmp_path, CUDA_JOB, base)
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0 and "warm start" in err, (out, err)
            start, after = (json.loads(line) for line in out.splitlines()[:2])
            assert start == {"at_start": False} and after == {"after": True}, out
            wait_ready(tmp_path, 1)
            state = status(str(server_folders(tmp_path)[0]))
            assert state is not None
            spare = int(state["spares"][0])
            forker = parent_of(spare)
            assert forker != int(state["pid"])  # forked
            query = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=60)
            on_gpu = {int(x) for x in query.stdout.split() if x.strip().isdigit()}
            assert not {spare, forker} & on_gpu, on_gpu
    finally:
        stop_servers(tmp_path)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_folder_of_another_uid_or_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    job = "import os\nprint('ran', os.getpid(), flush=True)\n"
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # nobody's
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    for base, why in ((theirs, "is owned by uid 65534"), (link, "is not a folder (a symbolic link?)"),
                      (open_dir, "is open to other users")):
        proc = worker(tmp_path, job, dict(env(tmp_path, TORCHELASTIC_RUN_ID="r"), UNBROKEN_SPARES_DIR=str(base)))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip() == f"ran {proc.pid}", (out, err)
        assert "cold start: no spare server" in err and why in err, err
    assert not list(real.iterdir()) and not list(theirs.iterdir())  # nothing created through them


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_training_dies_with_its_worker(tmp_path: Path) -> None:
    job = "import os, time\nprint('ran', os.getpid(), flush=True)\ntime.sleep(120)\n"
    proc = worker(tmp_path, job, env(tmp_path, TORCHELASTIC_RUN_ID="job-2", LOCAL_WORLD_SIZE="1", RANK="0"))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ran "), (line, proc.stderr.read() if proc.stderr else "")
        training = int(line.split()[1])
        assert training != proc.pid
        proc.kill()  # SIGKILL, as torchrun's last resort
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive(training) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(training), "the training outlived its worker"
    finally:
        stop_servers(tmp_path)


def test_two_hosts_agents_of_the_same_pid_have_servers_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spares folder on a filesystem the nodes share (``UNBROKEN_SPARES_DIR`` on NFS): agents of the same pid
    and run on two hosts get two server folders (a unix socket reaches only its own host's server)."""
    from unbroken.launch import wire

    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    a = wire.key("run", 1234, sys.executable)
    assert wire.key("run", 1234, sys.executable) == a  # stable on one host
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    assert wire.key("run", 1234, sys.executable) != a
    assert wire.key("run", 1235, sys.executable) != wire.key("run", 1234, sys.executable)
