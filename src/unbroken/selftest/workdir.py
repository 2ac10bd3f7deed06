"""The work folder a tool owns: created marked, emptied only where the mark says the tool made it.

``unbroken selftest --workdir DIR`` and ``unbroken demo --workdir DIR`` keep their runs in a folder
the user names. Such a folder may already exist: a previous selftest's (reuse it), an empty one
(take it), or the user's project (``--workdir .``). :func:`claim_workdir` tells them apart by a
marker file, ``.unbroken-<tool>``, written into every folder the tool takes:

- a missing folder is created, an empty one is taken; either gets the marker;
- a folder with the tool's marker is reused: the entries the tool creates there (``names``) are
  removed, nothing else (a note the user put beside them stays); a link among them is unlinked,
  never followed;
- anything else (a non-empty folder without the marker, another tool's folder, a file, a link
  to a folder without the marker) is refused with :class:`~unbroken.errors.TargetExistsError`
  before anything is written or removed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..errors import TargetExistsError


def marker(tool: str) -> str:
    """The name of the file that marks a work folder of ``tool`` (``"selftest"``, ``"demo"``)."""
    return f".unbroken-{tool}"


def claim_workdir(path: str | os.PathLike[str], tool: str, names: Iterable[str]) -> Path:
    """Make ``path`` ``tool``'s work folder (see the module docstring) and return it; ``names`` are the
    entries ``tool`` creates in it, removed when a marked folder is reused."""
    base = Path(path)
    mark = base / marker(tool)
    if os.path.lexists(base) and not base.is_dir():
        raise TargetExistsError(f"{base} exists and is not a folder: {tool} needs a folder of its own; "
                                "give a new or empty folder with --workdir (nothing was changed)")
    if base.is_dir():
        if not mark.is_file() or mark.is_symlink():
            entries = sorted(os.listdir(base))
            if entries:
                shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                raise TargetExistsError(
                    f"{base} is not empty ({shown}) and is not a folder that unbroken {tool} made (it has no "
                    f"{marker(tool)} file): {tool} never removes what it did not create; give a new or empty "
                    "folder with --workdir (nothing was changed)")
        else:
            for name in names:
                _remove(base / name)
    else:
        base.mkdir(parents=True)
    if not mark.is_file():
        mark.write_text(json.dumps({"made_by": f"unbroken {tool}", "removes": sorted(names)}) + "\n")
    return base


def _remove(path: Path) -> None:
    """Remove one entry the tool created: a link or a file is unlinked, a folder removed (links in it
    are not followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
