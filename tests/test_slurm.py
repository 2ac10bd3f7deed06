"""Preemption and requeue on a real SLURM cluster, resumed bitwise identically.

The tests start a private one-node cluster (``tests/slurm_cluster.py``: its own
munged, slurmctld and slurmd under a temp dir) and submit real batch jobs to it.

How the preemption signal reaches Python (checked with SLURM 22.05.8, Debian 12):

- The job script ``exec``\\ s Python, so the training process *is* the batch step's
  main process (no shell in between that would have to trap and forward the signal).
- ``scancel --signal=USR1 --batch JOBID`` signals exactly that process (what the test
  uses). A plain ``scancel --signal=USR1 JOBID`` signals only the job's srun steps,
  so a batch-only job never sees it; ``--full`` signals the batch shell, its children
  and all steps (also works, and is the choice when the script does not exec).
- For the same reason a real job asks for the warning signal with the ``B:`` prefix:
  ``#SBATCH --signal=B:USR1@60`` (the script below does; with ``--time=10`` it would
  fire after 9 minutes, long after the test has sent USR1 itself).
- ``scontrol requeue`` (run by the training process after its save) makes SLURM end
  the job (SIGTERM, then SIGKILL after KillWait) and queue it again, PENDING with
  Reason=BeginTime until requeue time + cred_expire + 1 s (120 s by default; the test
  cluster sets cred_expire=10). The test waits for that instead of forcing a start with
  ``scontrol update jobid=JOBID StartTime=now``: a relaunch within the same second as
  the requeue's kill is refused by slurmd ("Job credential revoked") and the job ends
  FAILED (2 of the first 9 runs here). SLURM discards the exit status of the
  requeued attempt, so EXIT_PREEMPTED is not checked here.
- There is no slurmdbd (no ``sacct``): job state comes from ``scontrol show job``
  (kept for MinJobAge seconds after the end), the attempts from the output file,
  which ``--open-mode=append`` keeps across the requeue.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import CRED_EXPIRE, TERMINAL_STATES, ClusterError, SlurmCluster, ensure_installed
from unbroken.demo import compare
from ports import free_ports

pytestmark = [pytest.mark.slurm, pytest.mark.e2e, pytest.mark.slow]

STEPS, SAVE_EVERY, HIDDEN, SEED = 150, 10, 256, 3
SIGNAL_AFTER = 20  # send USR1 once the job has printed this step


def train_args(base: Path) -> list[str]:
    return ["-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out", str(base / "out"),
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--hidden", str(HIDDEN),
            "--seed", str(SEED), "--requeue"]


@pytest.fixture(scope="module")
def cluster():
    reason = ensure_installed()
    if reason:
        if os.environ.get("UNBROKEN_REQUIRE_SLURM"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    c = SlurmCluster()
    try:
        c.start()
    except ClusterError as e:
        pytest.fail(f"could not start the SLURM test cluster (UNBROKEN_SLURM_KEEP=1 keeps {c.dir}):\n{e}",
                    pytrace=False)
    yield c
    c.stop()


def fail(msg: str, cluster: SlurmCluster, *files: Path) -> None:
    pytest.fail(f"{msg}\n{cluster.diagnostics(*files)}", pytrace=False)


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def wait_job(cluster: SlurmCluster, job: str, out: Path, timeout: float, what: str, ok) -> dict[str, str]:
    """Wait until ``ok(fields, output)``; fail at once if the job ends first, or at the timeout."""
    def check():
        fields = cluster.job(job)
        if ok(fields, read(out)):
            return fields
        if fields.get("JobState") in TERMINAL_STATES:
            fail(f"job {job} ended ({fields.get('JobState')}, ExitCode={fields.get('ExitCode')}, "
                 f"Restarts={fields.get('Restarts')}) while waiting for {what}", cluster, out)
        return None
    try:
        return cluster.wait(check, timeout, what, interval=0.1, files=(out,))
    except ClusterError as e:
        pytest.fail(f"job {job}: {cluster.job(job)}\n{e}", pytrace=False)


def last_step(text: str) -> int:
    steps = re.findall(r"^step (\d+)$", text, re.MULTILINE)
    return int(steps[-1]) if steps else 0


def starts(lines: list[str]) -> list[str]:
    return [x for x in lines if x == "fresh start" or x.startswith("resumed from step ")]


def steps_of(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for x in lines if (m := re.fullmatch(r"step (\d+)", x))]


def test_smoke_sbatch_wrap(cluster: SlurmCluster) -> None:
    """The cluster runs a trivial batch job to completion."""
    out = cluster.dir / "smoke.out"
    job = cluster.sbatch("--output", str(out), "--wrap", "echo hi from $SLURM_JOB_ID")
    fields = wait_job(cluster, job, out, 30, "the job to complete",
                      lambda f, _: f.get("JobState") == "COMPLETED")
    assert fields.get("ExitCode") == "0:0", fields
    assert read(out).strip() == f"hi from {job}", cluster.diagnostics(out)


def test_preempt_requeue_resume_bitwise(cluster: SlurmCluster, tmp_path: Path) -> None:
    """USR1 -> save at the step boundary -> scontrol requeue -> resumed by SLURM -> bitwise equal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONUNBUFFERED"] = "1"
    helptext = subprocess.run([sys.executable, "-m", "unbroken.demo.train", "--help"], env=env,
                              capture_output=True, text=True, timeout=60).stdout
    assert "--requeue" in helptext, f"unbroken.demo.train has no --requeue option:\n{helptext}"

    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def mark(what: str) -> None:
        timings[what] = round(time.monotonic() - t0, 1)
        print(f"{timings[what]:6.1f} s  {what}", flush=True)

    # (1) the reference: the same command, run directly to the end
    ref = tmp_path / "reference"
    proc = subprocess.run([sys.executable, *train_args(ref)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), \
        f"reference run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"

    mark("reference run done")

    # (2) the same run as a requeueable SLURM batch job, preempted with USR1 mid-run
    work = tmp_path / "slurm"
    work.mkdir()
    out = work / "job.out"
    script = work / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=unbroken-preempt
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}
#SBATCH --chdir={work}
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --time=10
#SBATCH --signal=B:USR1@60
echo "attempt: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}}"
export PYTHONUNBUFFERED=1
exec {shlex.join([sys.executable, *train_args(work)])}
""")
    job = cluster.sbatch(str(script))

    wait_job(cluster, job, out, 90, f"the job to print step {SIGNAL_AFTER}",
             lambda f, text: f.get("JobState") == "RUNNING" and last_step(text) >= SIGNAL_AFTER)
    signalled_after = last_step(read(out))
    mark(f"job printed step {signalled_after}: sending USR1")
    cluster.run("scancel", "--signal=USR1", "--batch", job)

    fields = wait_job(cluster, job, out, 60, "the job to save, requeue itself and be PENDING again",
                      lambda f, _: f.get("JobState") == "PENDING" and int(f.get("Restarts", "0")) >= 1)
    mark(f"job requeued: {fields.get('JobState')}, Reason={fields.get('Reason')}, "
         f"StartTime={fields.get('StartTime')}")
    assert fields.get("Reason") in {"BeginTime", "None", "Priority", "Resources"}, fields
    fields = wait_job(cluster, job, out, 60 + CRED_EXPIRE, "the requeued job to start again and run to the end",
                      lambda f, _: f.get("JobState") == "COMPLETED")

    mark("requeued job completed")

    # (3) what the two attempts printed
    text = read(out)
    diag = cluster.diagnostics(out)
    assert fields.get("Restarts") == "1" and fields.get("ExitCode") == "0:0", f"{fields}\n{diag}"
    lines = text.splitlines()
    attempts = [i for i, line in enumerate(lines) if line.startswith("attempt: ")]
    assert [lines[i] for i in attempts] == [f"attempt: job {job} restart 0", f"attempt: job {job} restart 1"], diag
    first, second = lines[attempts[0]:attempts[1]], lines[attempts[1]:]
    preempted = [int(m.group(1)) for x in first if (m := re.match(r"preempted at step (\d+)", x))]
    assert starts(first) == ["fresh start"], diag
    assert len(preempted) == 1 and signalled_after <= preempted[0] < STEPS, diag
    step = preempted[0]
    assert starts(second) == [f"resumed from step {step}"], diag
    assert steps_of(first) == list(range(1, step + 1)), diag
    assert steps_of(second) == list(range(step + 1, STEPS + 1)), diag
    assert "done" in second and "done" not in first, diag
    assert not any("preempted at step" in x for x in second), diag

    # (4) bitwise identical to the uninterrupted run
    results = compare(ref / "out", work / "out")
    assert all(results.values()), f"not bitwise identical after preemption at step {step}: {results}\n{diag}"


def test_two_task_job_preempted_requeued_resumed_bitwise(cluster: SlurmCluster, tmp_path: Path) -> None:
    """``srun`` with 2 tasks (gloo): USR1 to the step -> both ranks save the same step -> rank 0
    requeues -> SLURM starts the job again -> both ranks resume -> bitwise equal to 2 ranks run
    straight through."""
    import json

    import torch
    from safetensors.torch import load_file

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    script_py = Path(__file__).parent / "dist_train.py"
    steps, save_every = 40, 5

    def args(base: Path) -> list[str]:
        return [str(script_py), "--run-dir", str(base / "run"), "--out", str(base / "out"), "--mode", "ddp",
                "--steps", str(steps), "--save-every", str(save_every), "--requeue"]

    ref = tmp_path / "reference"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *args(ref)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    work = tmp_path / "slurm"
    work.mkdir()
    out = work / "job.out"
    # a port per attempt, below the ephemeral range (:mod:`ports`): the requeued attempt's group found the
    # one port it shared with the first attempt taken (EADDRINUSE, in CI)
    first_port, requeued_port = free_ports(2)
    task = (f"RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID MASTER_ADDR=127.0.0.1 "
            f"MASTER_PORT=$(( ${{SLURM_RESTART_COUNT:-0}} ? {requeued_port} : {first_port} )) "
            f"exec {shlex.join([sys.executable, *args(work)])}")
    (work / "job.sh").write_text(f"""#!/bin/bash
#SBATCH --job-name=unbroken-2tasks
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}
#SBATCH --chdir={work}
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=10
echo "attempt: restart ${{SLURM_RESTART_COUNT:-0}}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
srun --kill-on-bad-exit=0 bash -c {shlex.quote(task)}
""")
    job = cluster.sbatch(str(work / "job.sh"))
    wait_job(cluster, job, out, 120, "both tasks to print step 8",
             lambda f, text: "rank 0 step 8" in text and "rank 1 step 8" in text)
    cluster.run("scancel", "--signal=USR1", job)  # the job's steps: every task gets USR1
    fields = wait_job(cluster, job, out, 90, "the job to save, requeue itself and be PENDING again",
                      lambda f, _: f.get("JobState") == "PENDING" and int(f.get("Restarts", "0")) >= 1)
    fields = wait_job(cluster, job, out, 120 + CRED_EXPIRE, "the requeued job to run to the end",
                      lambda f, _: f.get("JobState") == "COMPLETED")
    text = read(out)
    diag = cluster.diagnostics(out)
    assert fields.get("Restarts") == "1", f"{fields}\n{diag}"
    preempted = re.findall(r"^preempted at step (\d+)$", text, re.MULTILINE)
    assert len(preempted) == 2 and len(set(preempted)) == 1, diag  # both ranks, the same step
    step = int(preempted[0])
    assert text.count(f"resumed from step {step}") == 2, diag
    a, b = load_file(str(ref / "out" / "final.safetensors")), load_file(str(work / "out" / "final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), diag
    for rank in (0, 1):
        rows = [json.loads(x) for x in (work / "out" / f"losses-r{rank}.jsonl").read_text().splitlines()]
        refs = [json.loads(x) for x in (ref / "out" / f"losses-r{rank}.jsonl").read_text().splitlines()]
        assert {r["step"]: r["loss"] for r in rows} == {r["step"]: r["loss"] for r in refs}, diag


def test_warm_restarts_inside_a_job_a_killed_rank_comes_back_from_a_spare_and_the_run_is_exact(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """``srun torchrun ... -m unbroken.launch.worker train.py`` in a batch job (docs/faults.md, "Warm restarts"):
    rank 1's training SIGKILLed while it holds at step 12, once the spares that replace it are ready; torchrun
    restarts both workers inside the job, both from warm spares (four warm starts, no cold one), both ranks
    resume from step 10, the job completes and ends bitwise equal to a plain (cold) torchrun run of the same
    script; the spare server does not outlive the job (SLURM's process tracking here does not follow a detached
    process: the server ends because its agent did)."""
    from procs import alive
    from test_warm_restart_torchrun import START, TRAIN, server_folders, stop_servers, wait_ready
    from test_warm_restart_torchrun import env as warm_env
    from test_warm_restart_torchrun import torchrun as warm_torchrun

    work = tmp_path / "slurm"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    out = work / "job.out"
    cmd = [*warm_torchrun("-m", "unbroken.launch.worker", restarts=1), "train.py", str(work / "run"), "30",
           str(work / "final")]
    (work / "job.sh").write_text(f"""#!/bin/bash
#SBATCH --job-name=unbroken-warm
#SBATCH --output={out}
#SBATCH --chdir={work}
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=10
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 UNBROKEN_SPARES_DIR={shlex.quote(str(tmp_path / "spares"))}
export UNBROKEN_SPARES_IDLE_S=30 HOLD_AT=12
srun {shlex.join(cmd)}
""")
    try:
        job = cluster.sbatch(str(work / "job.sh"))
        wait_job(cluster, job, out, 180, "rank 1 to hold at step 12",
                 lambda f, text: "rank 1 step 12" in text and (work / "run.held-12").exists())
        wait_ready(tmp_path, 2)
        (server,) = server_folders(tmp_path)
        server_pid = int((server / "pid").read_text())
        pid = next(int(p) for r, p, _, _ in START.findall(read(out)) if r == "1")
        os.kill(pid, signal.SIGKILL)
        fields = wait_job(cluster, job, out, 180, "the job to complete", lambda f, _: f.get("JobState") == "COMPLETED")
        text, diag = read(out), cluster.diagnostics(out)
        assert fields.get("ExitCode") == "0:0", diag
        assert text.count("warm start: the spare") == 4 and "cold start" not in text, diag
        assert text.count("resumed from step 10") == 2, diag
        deadline = time.monotonic() + 60
        while alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server_pid), "the spare server outlived the job"

        ref = tmp_path / "reference"
        ref.mkdir()
        (ref / "train.py").write_text(TRAIN)
        proc = subprocess.run([*warm_torchrun(restarts=0), "train.py", str(ref / "run"), "30", str(ref / "final")],
                              cwd=ref, env=warm_env(tmp_path), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert (work / "final").read_text() == (ref / "final").read_text()
    finally:
        stop_servers(tmp_path)
