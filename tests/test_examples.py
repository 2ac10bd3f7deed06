"""Every script in examples/, run for real: interrupted the way its docstring says it survives,
resumed, and compared bitwise with an uninterrupted run of the same script.

- quickstart.py, iterable_data.py: SIGKILL (the whole process group, DataLoader workers too)
  after a step, run again, compare every step's printed loss and the final sha256.
- torchrun_ddp.py: under the venv's torchrun with 2 ranks and --max-restarts 1; rank 1 is
  SIGKILLed mid-run, torchrun restarts both ranks, which resume and finish bitwise.
- s3_train.py: on the test SeaweedFS server (tests/s3_server.py): killed mid-run, the
  committed checkpoints are in the bucket and the next run resumes from the newest one; tiered
  (local folder + Remote): the local folder is wiped and the run continues from S3.
- slurm/: the batch script submitted with sbatch to the real one-node cluster of
  tests/slurm_cluster.py, preempted with USR1, requeued by unbroken, resumed by SLURM.

Each example prints ``step N ...`` lines (its loss, bitwise as ``repr``) and a final line with
a sha256 of its parameters and optimizer state; those are what is compared.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

import unbroken
from conftest import real_pid
from slurm_cluster import CRED_EXPIRE
from test_slurm import cluster, wait_job  # noqa: F401 - the SLURM tests' cluster fixture, reused

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
STEP = re.compile(r"(?:rank (\d+) )?step (\d+) (.*)")


@dataclass
class Result:
    rc: int
    lines: list[str]
    killed: bool = False

    @property
    def text(self) -> str:
        return "\n".join(self.lines[-80:])

    def steps(self) -> dict[tuple[int, int], str]:
        """(rank, step) -> the rest of its last ``step`` line (loss, records...)."""
        out = {}
        for line in self.lines:
            if m := STEP.fullmatch(line):
                out[(int(m.group(1) or 0), int(m.group(2)))] = m.group(3)
        return out

    def last_step(self) -> int:
        return max((s for _, s in self.steps()), default=0)

    def first(self, prefix: str) -> list[str]:
        return [x for x in self.lines if x.startswith(prefix)]


def run(cmd: list[str], *, env: dict[str, str] | None = None, kill=None, timeout: float = 180) -> Result:
    """Run an example, output and errors interleaved line by line (each read from its own pipe: a
    log line written by a thread between a ``print``'s text and its newline would otherwise land
    inside a step line). ``kill(line, proc)`` is called for every output line and returns True
    once it has killed something."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or ENV, cwd=REPO, start_new_session=True)
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    res = Result(0, [])

    def errors() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            res.lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=errors, daemon=True)
    reader.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            res.lines.append(line.rstrip("\n"))
            if kill is not None and not res.killed:
                res.killed = bool(kill(line.rstrip("\n"), proc))
        res.rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=30)
    return res


def kill_group_after(step: int):
    """SIGKILL the example's whole process group once it printed ``step <n>`` with n >= step."""
    def kill(line: str, proc: subprocess.Popen) -> bool:
        m = STEP.fullmatch(line)
        if m and int(m.group(2)) >= step:
            os.killpg(proc.pid, signal.SIGKILL)
            return True
        return False
    return kill


def check_kill_and_resume(ref: Result, killed: Result, resumed: Result, steps: int, save_every: int) -> int:
    """The killed run died mid-way; the resumed one starts at the newest checkpoint the killed
    one committed and prints exactly the reference's losses; both end like the reference."""
    assert ref.rc == 0, ref.text
    assert sorted(s for _, s in ref.steps()) == list(range(1, steps + 1)), ref.text
    assert killed.killed and killed.rc == -signal.SIGKILL, killed.text
    assert not killed.first("final"), killed.text
    done = killed.last_step()
    assert done < steps, killed.text
    assert resumed.rc == 0, resumed.text
    starts = [x for x in resumed.lines if x.startswith(("resumed from step", "fresh start"))]
    assert len(starts) == 1 and starts[0].startswith("resumed from step "), resumed.text
    at = int(starts[0].split()[3])
    # a save happens inside step()'s call, before the step is printed: the newest save at or
    # before the last printed step, or the one of the next step if the kill fell just after it
    assert at % save_every == 0 and done - save_every < at <= done + 1, (done, starts[0])
    assert sorted(s for _, s in resumed.steps()) == list(range(at + 1, steps + 1)), resumed.text
    ref_steps = ref.steps()
    for got in (killed.steps(), resumed.steps()):
        assert got == {k: ref_steps[k] for k in got}, "a step computed something else than in the reference"
    assert resumed.first("final") == ref.first("final") != [], (resumed.first("final"), ref.first("final"))
    return at


# --------------------------------------------------------------------------- quickstart
@pytest.mark.e2e
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_quickstart_killed_and_resumed_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    steps, save_every = 120, 20

    def cmd(run_dir: Path, workers: int) -> list[str]:
        return [sys.executable, str(EXAMPLES / "quickstart.py"), "--run-dir", str(run_dir), "--steps", str(steps),
                "--save-every", str(save_every), "--workers", str(workers)]

    ref = run(cmd(tmp_path / "ref", 0))
    # the interrupted run uses DataLoader workers: the data position does not depend on them
    killed = run(cmd(tmp_path / "run", 2), kill=kill_group_after(30))
    checkpoints = sorted(p.name for p in (tmp_path / "run").glob("step-*"))
    resumed = run(cmd(tmp_path / "run", 2))
    at = check_kill_and_resume(ref, killed, resumed, steps, save_every)
    assert f"step-{at:09d}" in checkpoints, checkpoints
    # keep_last=3, as in the README's loop
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == [f"step-{s:09d}" for s in (80, 100, 120)]
    again = run(cmd(tmp_path / "run", 0))  # a finished run: nothing to do, same parameters
    assert again.rc == 0 and again.first("resumed from step 120") and not again.steps(), again.text
    assert again.first("final")[0].split()[-1] == ref.first("final")[0].split()[-1]


# ------------------------------------------------------------------------ iterable data
@pytest.mark.e2e
def test_iterable_data_killed_and_resumed_by_byte_offset(tmp_path: Path) -> None:
    steps, save_every, batch = 150, 25, 16  # 2000 records per pass: the run crosses into a second pass

    def cmd(run_dir: Path) -> list[str]:
        return [sys.executable, str(EXAMPLES / "iterable_data.py"), "--data-dir", str(tmp_path / "data"),
                "--run-dir", str(run_dir), "--steps", str(steps), "--save-every", str(save_every),
                "--batch-size", str(batch)]

    ref = run(cmd(tmp_path / "ref"))
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [f"part-{i:05d}.jsonl" for i in range(4)]
    killed = run(cmd(tmp_path / "run"), kill=kill_group_after(60))
    resumed = run(cmd(tmp_path / "run"))
    at = check_kill_and_resume(ref, killed, resumed, steps, save_every)
    # the reader resumed at the record after the checkpoint's batch, found by its byte offset
    assert resumed.first(f"resumed from step {at} at record {at * batch} "), resumed.text
    assert resumed.steps()[(0, at + 1)].endswith(f"records {at * batch % 2000}-{at * batch % 2000 + batch - 1}")
    assert not any("replaying" in x for x in resumed.lines), resumed.text
    assert resumed.first("final")[0].startswith(f"final records {steps * batch} ")


# ----------------------------------------------------------------------------- torchrun
def torchrun() -> list[str]:
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def rank_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun ``agent``'s worker with RANK=rank (its children, found in /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"\nPPid:\t{agent}\n" in status and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.e2e
def test_torchrun_ddp_rank_killed_torchrun_restarts_and_both_ranks_resume_bitwise(tmp_path: Path) -> None:
    steps, save_every = 40, 10

    def cmd(run_dir: Path, restarts: int) -> list[str]:
        return [*torchrun(), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
                str(EXAMPLES / "torchrun_ddp.py"), "--run-dir", str(run_dir), "--steps", str(steps),
                "--save-every", str(save_every)]

    ref = run(cmd(tmp_path / "ref", 0))
    assert ref.rc == 0, ref.text
    ref_done = ref.first("rank ")
    ref_sha = {x.split()[1]: x.split()[-1] for x in ref_done if ": done, sha256 " in x}
    assert set(ref_sha) == {"0:", "1:"} and len(set(ref_sha.values())) == 1, ref.text  # both ranks agree
    assert set(ref.steps()) == {(r, s) for r in (0, 1) for s in range(1, steps + 1)}, ref.text
    assert ref.steps()[(0, 1)] != ref.steps()[(1, 1)]  # each rank trains on its own slice of the data

    def attempt(run_dir: Path) -> bool:
        """Kill rank 1 past step 15 and resume; True if steps ran twice (the kill fell between saves, the
        case this test is for), False if it landed just after a save (bitwise too, but nothing re-ran)."""
        killed_pid: list[int] = []

        def kill_rank_1(line: str, proc: subprocess.Popen) -> bool:
            m = STEP.fullmatch(line)
            if m and m.group(1) == "1" and int(m.group(2)) >= 15:
                pid = rank_pid(real_pid(proc), 1)
                assert pid is not None, "rank 1's process not found among torchrun's children"
                os.kill(real_pid(pid), signal.SIGKILL)  # the rank itself, when the zygote forked it
                killed_pid.append(pid)
                return True
            return False

        got = run(cmd(run_dir, 1), kill=kill_rank_1)
        assert got.killed and got.rc == 0, got.text  # torchrun restarted the group, which finished
        starts = [x for x in got.lines if re.fullmatch(r"rank \d: (fresh start|resumed from step \d+)", x)]
        assert sorted(starts[:2]) == ["rank 0: fresh start", "rank 1: fresh start"], starts
        resumed = sorted(starts[2:])
        assert len(resumed) == 2 and resumed[0].startswith("rank 0: resumed from step "), starts
        at = int(resumed[0].split()[-1])
        assert resumed == [f"rank 0: resumed from step {at}", f"rank 1: resumed from step {at}"], starts
        assert at % save_every == 0 and 10 <= at < steps, starts
        sha = {x.split()[1]: x.split()[-1] for x in got.lines if ": done, sha256 " in x}
        assert sha == ref_sha, (sha, ref_sha)
        # every step of every rank printed (the last time: steps after the checkpoint ran twice) is the
        # reference's, and every step after the resume was printed; a step saved just before the kill landed
        # may never be printed (the kill fell between its save and its line, and the resume starts after it)
        printed = got.steps()
        assert printed == {k: ref.steps()[k] for k in printed}
        assert {(r, s) for r in (0, 1) for s in range(at + 1, steps + 1)} <= set(printed)
        # and the steps re-run after the restart printed what they printed the first time
        first_pass = Result(0, got.lines[:got.lines.index(starts[2])]).steps()
        assert first_pass == {k: ref.steps()[k] for k in first_pass}
        return any(s > at for _, s in first_pass)

    # under load the kill may land after the next save, so that nothing re-runs: then again, at most 3 times
    assert any(attempt(tmp_path / f"run{i}") for i in range(3)), "no step ran twice: the kill never tested a resume"


# ----------------------------------------------------------------------------------- S3
S3_STEPS, S3_SAVE_EVERY = 60, 10


def s3_cmd(run: str, *extra: str, steps: int = S3_STEPS) -> list[str]:
    return [sys.executable, str(EXAMPLES / "s3_train.py"), "--run", run, "--steps", str(steps),
            "--save-every", str(S3_SAVE_EVERY), *extra]


@pytest.fixture(scope="module")
def s3_reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """The same script saving to a local folder, never interrupted."""
    ref = run(s3_cmd(str(tmp_path_factory.mktemp("s3-ref") / "run")))
    assert ref.rc == 0 and ref.first("final"), ref.text
    return ref


def committed_in_bucket(s3, url: str) -> list[str]:
    """The checkpoint folders under ``url`` that have a manifest.json (read with s3fs directly)."""
    fs = s3.fs()
    prefix = url.removeprefix("s3://")
    return sorted(Path(p).parent.name for p in fs.glob(f"{prefix}/step-*/manifest.json"))


@pytest.mark.e2e
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_s3_killed_and_resumed_from_the_bucket(s3_reference: Result, s3, s3_url: str, tmp_path: Path) -> None:
    # credentials from the environment as a job gets them; the endpoint from the command line
    env = dict(ENV, **s3.env)
    env.pop("AWS_ENDPOINT_URL")
    killed = run(s3_cmd(s3_url, "--endpoint-url", s3.endpoint), env=env, kill=kill_group_after(25))
    in_bucket = committed_in_bucket(s3, s3_url)
    assert in_bucket and in_bucket[-1] <= f"step-{killed.last_step() + 1:09d}", (in_bucket, killed.text)
    assert {"step-000000010", "step-000000020"} <= set(in_bucket), in_bucket
    for name in in_bucket:  # each is complete: every object there, checksums right
        unbroken.verify(f"{s3_url}/{name}", storage_options=s3.storage_options)
    assert not (REPO / "s3:").exists()  # a URL, never a local folder named "s3:"
    resumed = run(s3_cmd(s3_url, "--endpoint-url", s3.endpoint), env=env)
    at = check_kill_and_resume(s3_reference, killed, resumed, S3_STEPS, S3_SAVE_EVERY)
    assert f"step-{at:09d}" == in_bucket[-1], (at, in_bucket)  # the newest checkpoint in the bucket
    assert committed_in_bucket(s3, s3_url)[-1] == f"step-{S3_STEPS:09d}"


@pytest.mark.e2e
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_s3_tiered_local_folder_lost_run_continues_from_s3(s3_reference: Result, s3, s3_url: str,
                                                           tmp_path: Path) -> None:
    # endpoint and credentials from the AWS_* variables only (no --endpoint-url)
    env = dict(ENV, **s3.env)
    local = tmp_path / "local"
    first = run(s3_cmd(s3_url, "--local", str(local), steps=30), env=env)
    assert first.rc == 0 and first.first("fresh start"), first.text
    assert first.first("newest checkpoint step-000000030 in local and remote"), first.text
    assert committed_in_bucket(s3, s3_url) == ["step-000000010", "step-000000020", "step-000000030"]

    shutil.rmtree(local)  # a new machine: nothing local
    second = run(s3_cmd(s3_url, "--local", str(local)), env=env)
    assert second.rc == 0, second.text
    assert second.first("resumed from step 30"), second.text  # its only copy was in the bucket
    assert sorted(s for _, s in second.steps()) == list(range(31, S3_STEPS + 1)), second.text
    ref = s3_reference.steps()
    assert second.steps() == {k: ref[k] for k in second.steps()}
    assert first.steps() == {k: ref[k] for k in first.steps()}
    assert second.first("final") == s3_reference.first("final")  # 30 + 30 steps == 60 steps, bitwise
    assert committed_in_bucket(s3, s3_url)[-5:] == [f"step-{s:09d}" for s in (20, 30, 40, 50, 60)]  # keep_last=5


# -------------------------------------------------------------------------------- SLURM
@pytest.mark.e2e
@pytest.mark.slow  # another framework's job in every process
@pytest.mark.parametrize("example", ["hf_trainer.py", "lightning_train.py"])
def test_framework_example_killed_inside_a_save_resumes_bitwise(tmp_path: Path, example: str) -> None:
    """The HF Trainer and Lightning examples: SIGKILLed inside their 3rd save (just before it would
    commit), run again, they end with the uninterrupted run's final line (loss, step, sha256)."""

    def cmd(run_dir: Path) -> list[str]:
        return [sys.executable, f"examples/{example}", "--run-dir", str(run_dir), "--steps", "40", "--save-every", "10"]

    ref = run(cmd(tmp_path / "ref"))
    assert ref.rc == 0, ref.text
    [want] = ref.first("final ")
    killed = run(cmd(tmp_path / "run"), env={**ENV, "UNBROKEN_FAULTS": "save.before_commit=3"})
    assert killed.rc == -signal.SIGKILL and not killed.first("final "), killed.text
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-000000010", "step-000000020"]
    resumed = run(cmd(tmp_path / "run"))
    assert resumed.rc == 0, resumed.text
    assert resumed.first("resumed from step 20") and resumed.first("final ") == [want]


@pytest.mark.slurm
def test_slurm_job_preempted_requeued_and_resumed_bitwise(cluster, tmp_path: Path) -> None:  # noqa: F811
    steps, save_every = 120, 20
    args = ["--steps", str(steps), "--save-every", str(save_every)]
    env = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")}
    ref = run([sys.executable, str(EXAMPLES / "slurm" / "train.py"), "--run-dir", str(tmp_path / "ref"), *args],
              env=env)
    assert ref.rc == 0 and ref.first("not in a SLURM job"), ref.text

    out = tmp_path / "job.out"
    job = cluster.sbatch(f"--chdir={REPO}", f"--output={out}",
                         f"--export=ALL,PYTHON={sys.executable},RUN_DIR={tmp_path / 'run'},OMP_NUM_THREADS=1",
                         str(EXAMPLES / "slurm" / "train.sbatch"), *args, "--step-time", "0.05")

    def printed_step(text: str, n: int) -> bool:
        return any(int(s) >= n for s in re.findall(r"^step (\d+) ", text, re.MULTILINE))

    wait_job(cluster, job, out, 90, "the job to print step 10",
             lambda f, text: f.get("JobState") == "RUNNING" and printed_step(text, 10))
    cluster.run("scancel", "--signal=USR1", "--batch", job)  # what --signal=B:USR1@120 sends before the limit
    wait_job(cluster, job, out, 60, "the job to save, requeue itself and be PENDING",
             lambda f, _: f.get("JobState") == "PENDING" and int(f.get("Restarts", "0")) >= 1)
    fields = wait_job(cluster, job, out, 90 + CRED_EXPIRE, "the requeued job to run to the end",
                      lambda f, _: f.get("JobState") == "COMPLETED")
    assert fields.get("Restarts") == "1" and fields.get("ExitCode") == "0:0", fields

    lines = out.read_text().splitlines()
    diag = "\n".join(lines[-60:])
    attempts = [i for i, x in enumerate(lines) if x.startswith("attempt: ")]
    assert [lines[i].split(" on ")[0] for i in attempts] == [f"attempt: job {job} restart 0",
                                                             f"attempt: job {job} restart 1"], diag
    first = Result(0, lines[attempts[0]:attempts[1]])
    second = Result(0, lines[attempts[1]:])
    preempted = [int(m.group(1)) for x in first.lines if (m := re.fullmatch(r"preempted at step (\d+)", x))]
    assert len(preempted) == 1 and 10 <= preempted[0] < steps, diag
    at = preempted[0]
    # the signal is acted on in step()'s call of step `at`: saved, requeued, exited before printing it
    assert first.first("fresh start") and first.last_step() == at - 1 and not first.first("final"), diag
    assert second.first(f"SLURM job {job}, restart 1") and second.first(f"resumed from step {at}"), diag
    assert sorted(s for _, s in second.steps()) == list(range(at + 1, steps + 1)), diag
    ref_steps = ref.steps()
    for part in (first, second):
        assert part.steps() == {k: ref_steps[k] for k in part.steps()}, diag
    assert second.first("final") == ref.first("final") != [], diag
    assert (tmp_path / "run" / "submit.slurm").exists()  # written by unbroken inside the job
