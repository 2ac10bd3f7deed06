"""What ``unbroken run -- COMMAND`` runs, and whether a warm spare can run it.

A spare (:mod:`.spare`) is a Python interpreter started like the command's own, that has imported
torch and waits; it can become ``python [FLAGS] SCRIPT ARGS`` or ``python [FLAGS] -m MODULE ARGS``
exactly when it was started with the same interpreter and the same flags. :func:`parse` reads the
command into a :class:`Command`; a command it cannot read that way (another program, a flag that
changes how the interpreter starts in ways a spare cannot copy) gets cold restarts, with the reason.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

SIMPLE_FLAGS = ("-u", "-B", "-O", "-OO", "-s", "-E", "-b", "-bb", "-q")
"""Flags a spare is started with as they are (they act when the interpreter starts)."""
VALUE_FLAGS = ("-X", "-W")
"""Flags with a value (``-X dev``, ``-Xdev``, ``-W error``): passed on with their value."""


@dataclass
class Command:
    """``executable [flags] (script | -m module) args``, as the spare will run it."""

    argv: list[str]
    """The command as given."""
    executable: str | None = None
    flags: list[str] = field(default_factory=list)
    module: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)
    cold: str | None = None
    """Why a spare cannot run it (``None``: it can)."""

    @property
    def warm(self) -> bool:
        return self.cold is None

    def main_argv(self) -> list[str]:
        """``sys.argv`` of the training process: ``[script, *args]`` (``-m``: the module's path is filled
        in by runpy, as Python does)."""
        return [self.script if self.script is not None else "-m", *self.args]


def _is_python(program: str) -> str | None:
    path = shutil.which(program)
    if path is None:
        return None
    name = os.path.basename(program)
    return path if name.startswith("python") or os.path.realpath(path) == os.path.realpath(
        shutil.which("python3") or "") else None


def parse(argv: list[str]) -> Command:
    """Read ``argv`` (``python train.py --lr 3e-4``, ``python -u -m pkg.train``, or ``train.py ...`` for
    the Python running unbroken) into a :class:`Command` (see the module docstring)."""
    import sys

    cmd = Command(list(argv))
    if not argv:
        cmd.cold = "no command"
        return cmd
    rest = list(argv)
    if rest[0].endswith(".py") and os.path.isfile(rest[0]):
        cmd.executable = sys.executable  # `unbroken run -- train.py`: this Python
    else:
        exe = _is_python(rest[0])
        if exe is None:
            cmd.cold = f"{rest[0]!r} is not a Python interpreter: every restart runs the command from nothing"
            return cmd
        cmd.executable = exe
        rest = rest[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        flag = rest.pop(0)
        if flag in SIMPLE_FLAGS:
            cmd.flags.append(flag)
        elif flag in VALUE_FLAGS and rest:
            cmd.flags += [flag, rest.pop(0)]
        elif flag[:2] in VALUE_FLAGS and len(flag) > 2:
            cmd.flags.append(flag)
        else:
            cmd.cold = f"the interpreter flag {flag!r} is not one a spare can be started with"
            return cmd
    if rest[:1] == ["-m"] and len(rest) > 1:
        cmd.module, cmd.args = rest[1], rest[2:]
    elif rest and not rest[0].startswith("-"):
        cmd.script, cmd.args = rest[0], rest[1:]
        if not os.path.isfile(cmd.script):
            cmd.cold = f"{cmd.script}: no such file"
    else:
        cmd.cold = "neither a script nor -m MODULE follows the interpreter"
    return cmd
