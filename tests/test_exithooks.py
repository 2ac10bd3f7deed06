"""unbroken's exit hooks (a Checkpointer never closed, ``unbroken.save`` in the background) run once,
in the process that registered them: never in a forked child such as a DataLoader worker, where
``threading``'s exit hooks also run and closing the parent's Checkpointers would wait on threads
that do not exist there and write the parent's files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import multiprocessing, os, sys
from unbroken._support.exithooks import at_exit

log = sys.argv[1]

@at_exit
def record():
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")

ctx = multiprocessing.get_context("fork")
children = [ctx.Process(target=lambda: None) for _ in range(2)]
for c in children:
    c.start()
for c in children:
    c.join()
print(os.getpid(), flush=True)
"""


def test_exit_hooks_run_once_in_their_own_process_never_in_forked_children(tmp_path: Path) -> None:
    log = tmp_path / "ran"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert log.read_text().split() == [r.stdout.strip()]
