"""One attempt: start the script in a process group of its own, bound its time, clean up.

The script runs with the selftest's environment (:mod:`.protocol`), its stdout and stderr
going to files next to the records. An attempt that runs past ``timeout`` seconds is
killed with its whole process group (DataLoader workers, anything it started); after any
attempt the group is killed too, so no process outlives it, whatever the script did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TAIL = 4000
"""Characters of a failed attempt's stderr kept for the report."""


@dataclass
class Attempt:
    """How one process of a run went."""

    plan: str
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    stderr_tail: str = ""
    started: str = ""
    ended: str = ""
    records: list[dict] = field(default_factory=list)
    ranks: dict[int, int] = field(default_factory=dict)
    """Under torchrun: the exit status of each rank that failed (from torchrun's report)."""

    def as_dict(self) -> dict[str, object]:
        return {"plan": self.plan, "rc": self.rc, "ranks": {str(r): c for r, c in sorted(self.ranks.items())},
                "seconds": round(self.seconds, 3), "timed_out": self.timed_out, "started": self.started,
                "ended": self.ended}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_attempt(cmd: list[str], env: dict[str, str], logs: Path, timeout: float, plan: str) -> Attempt:
    """Run ``cmd`` once; ``logs`` is the stem of its ``.out``/``.err`` files."""
    att = Attempt(plan=plan)
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    t0 = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        try:
            proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        except OSError as ex:  # no such program
            att.rc, att.stderr_tail = 127, f"{type(ex).__name__}: {ex}"
            return att
        try:
            att.rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            att.timed_out = True
            _kill_group(proc.pid)
            att.rc = proc.wait()
        finally:  # also on KeyboardInterrupt: nothing of the script outlives the attempt
            _kill_group(proc.pid)
            if proc.returncode is None:
                proc.wait()
    att.seconds = time.monotonic() - t0
    att.stderr_tail = err.read_text(errors="replace")[-TAIL:]
    return att
