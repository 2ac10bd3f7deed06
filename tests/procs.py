"""Processes found through ``/proc``: by what they inherited — a variable of their environment
(``/proc/<pid>/environ``, the environment a process was started with: the tests mark what they start with a
variable of their own, a SLURM cluster's ``SLURM_CONF``, a test's ``UNBROKEN_RAM_ROOT``, and everything those
processes start inherits it, so a test finds the helpers and grandchildren it never saw the pids of) — or by
their parent; and whether one is still alive (a zombie is not)."""

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


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (exists and is not a zombie)."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def children(parent: int, command: bytes = b"") -> list[int]:
    """The pids of ``parent``'s children, those with ``command`` in their command line if it is given."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat(int(entry.name))[1]) != parent:
                continue
            if not command or command in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
    return found
