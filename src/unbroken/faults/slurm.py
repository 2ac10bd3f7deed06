"""SLURM: detect the job, requeue it after a preemption save, and write ``submit.slurm``.

The pattern that loses nothing on a SLURM cluster::

    #SBATCH --signal=B:USR1@120    # USR1 to the batch script two minutes before the time limit
    #SBATCH --requeue              # the job may be requeued
    #SBATCH --open-mode=append     # keep the log of every attempt
    exec python train.py           # python is the batch script: it receives the signal

(Without ``B:`` SLURM signals only the job's ``srun`` steps; a job whose ranks are ``srun``
steps uses ``--signal=USR1@120``.)

with ``Checkpointer(..., requeue=True)``: on USR1 the run saves at the next step
boundary, calls ``scontrol requeue $SLURM_JOB_ID`` and exits; SLURM starts it again
later and ``restore`` picks up the preemption checkpoint.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("unbroken")


def job_id() -> str | None:
    """The SLURM job id of this process (the array task's own id for job arrays), or None."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue() -> bool:
    """Ask SLURM to requeue this job; True if ``scontrol`` accepted it."""
    jid = job_id()
    if not jid:
        log.warning("requeue asked for, but this is not a SLURM job (no SLURM_JOB_ID)")
        return False
    try:
        out = subprocess.run(["scontrol", "requeue", jid], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("scontrol requeue %s failed: %s", jid, e)
        return False
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", jid, (out.stderr or out.stdout).strip())
        return False
    log.warning("requeued SLURM job %s", jid)
    return True


MARKER = "# Written by unbroken:"
"""The line that makes ``submit.slurm`` unbroken's to rewrite; without it the file is the user's."""

_SBATCH_FROM_ENV = (
    ("SLURM_JOB_NAME", "--job-name"), ("SLURM_JOB_PARTITION", "--partition"),
    ("SLURM_JOB_NUM_NODES", "--nodes"), ("SLURM_NTASKS", "--ntasks"),
    ("SLURM_CPUS_PER_TASK", "--cpus-per-task"), ("SLURM_JOB_ACCOUNT", "--account"),
    ("SLURM_JOB_QOS", "--qos"), ("SLURM_GPUS", "--gpus"), ("SLURM_GPUS_PER_NODE", "--gpus-per-node"),
)


def submit_script(run_dir: str | os.PathLike[str], signal_seconds: int = 120) -> str:
    """A batch script that resubmits this job as it is running now, resuming automatically."""
    lines = ["#!/bin/bash", f"{MARKER} `sbatch submit.slurm` continues this run from its newest",
             "# valid checkpoint. unbroken rewrites this file while it has this line: delete the line to keep",
             "# your own edits."]
    for var, flag in _SBATCH_FROM_ENV:
        if os.environ.get(var):
            lines.append(f"#SBATCH {flag}={os.environ[var]}")
    log_path = Path(run_dir) / "slurm-%j.out"
    # B: the signal goes to the batch script, which is the exec'd python below
    lines += [f"#SBATCH --signal=B:USR1@{signal_seconds}", "#SBATCH --requeue", "#SBATCH --open-mode=append",
              f"#SBATCH --output={log_path}", "", f"cd {shlex.quote(os.getcwd())}",
              "exec " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.orig_argv[1:]]), ""]
    return "\n".join(lines)


def write_submit_script(run_dir: str | os.PathLike[str]) -> Path:
    """Write ``submit.slurm`` into the run folder (atomically) and return its path."""
    from ..store.local import write_file_atomic

    path = Path(run_dir) / "submit.slurm"
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW | os.O_NONBLOCK)) as f:
            head = f.read(512)
    except FileNotFoundError:
        head = MARKER.encode()
    except OSError:  # a link, a FIFO, a folder: not ours
        head = b""
    if MARKER.encode() not in head:  # the user's own script (or ours, edited and unmarked): never replaced
        log.info("%s exists and was not written by unbroken; left as it is", path)
        return path
    write_file_atomic(path, submit_script(run_dir).encode(), mode=0o755)
    return path


class SubmitScript:
    """Plug-in: after the first save inside a SLURM job, write ``submit.slurm`` into ``run_dir``
    (the run folder, or the local cache folder of a remote run)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.done = run_dir, False

    def on_event(self, event: object) -> None:
        from ..events import Saved

        if isinstance(event, Saved) and not self.done and job_id():
            self.done = True
            log.debug("wrote %s", write_submit_script(self.run_dir))
