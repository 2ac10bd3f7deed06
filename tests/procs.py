"""Processes found by what they inherited: a variable of their environment (``/proc/<pid>/environ``, the
environment a process was started with). The tests mark what they start with a variable of their own
(a SLURM cluster's ``SLURM_CONF``, a test's ``UNBROKEN_RAM_ROOT``), and everything those processes start
inherits it: so a test finds the helpers and grandchildren it never saw the pids of."""

from __future__ import annotations

import os
from pathlib import Path


def with_environment(name: str, value: str, command: bytes = b"") -> list[int]:
    """The pids of the processes (this one excepted) started with ``name=value`` in their environment and,
    if ``command`` is given, with it in their command line. Zombies have neither and are not listed."""
    marker = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if command and command not in (entry / "cmdline").read_bytes():
                continue
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found
