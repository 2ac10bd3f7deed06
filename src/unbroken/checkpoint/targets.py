"""Where unbroken may write a file or folder a user named (``export --to``, ``plot -o``).

Never over what the tool did not write: an existing file only with ``--force`` (a tool may allow
its own earlier output), never a folder where a file goes, never through a link, never inside a
checkpoint folder or a run's folders, never a checkpoint or a hidden file into a run.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import TargetExistsError, UnbrokenError
from .manifests import is_run as api_is_run


def check_target(out: Path, *, force: bool, folder: bool, checkpoint: bool = False, tool: str = "export",
                 option: str = "--to") -> None:
    """Refuse (:class:`~unbroken.errors.TargetExistsError`) a target a user named that would destroy
    what ``tool`` did not write: an existing file without ``force``, a folder where a file goes, a link
    where a folder goes, anything inside a checkpoint folder or a run's folders, and an existing or hidden
    file in a run (``force`` or not).
    ``folder``: the target is a folder the tool writes files into (``hf``) or creates (``checkpoint``);
    ``checkpoint``: it becomes a checkpoint folder, so it must not land in a run either."""

    def is_run(place: Path) -> bool:  # a folder this user may not read (/home at 0711) is not a run
        try:
            return api_is_run(place)
        except (OSError, UnbrokenError):
            return False

    if os.path.islink(out) and folder:
        raise TargetExistsError(f"{out} is a symbolic link: {tool} does not write through a link; give the "
                                f"folder it points to, or a new path, with {option}")
    if os.path.lexists(out) and not os.path.islink(out):
        if os.path.isdir(out) != folder:
            what = "a folder" if os.path.isdir(out) else "a file"
            raise TargetExistsError(f"{out} exists and is {what}: {tool} never replaces it; choose another {option}")
        if not folder and not force:
            raise TargetExistsError(f"{out} exists: {tool} does not overwrite files it did not write; choose "
                                    f"another {option}, or pass --force to replace it")
    elif os.path.islink(out) and not force:
        raise TargetExistsError(f"{out} exists (a symbolic link): {tool} does not replace it; choose another "
                                f"{option}, or pass --force to replace the link (what it points to is not touched)")
    here = Path(os.path.realpath(out if folder and os.path.isdir(out) else out.parent))
    for place in (here, *here.parents):
        if (place / "manifest.json").exists():
            inside = f"the checkpoint {place}"
        elif place != place.parent and is_run(place.parent):
            inside = f"{place}, a folder of the run {place.parent}"
        else:
            continue
        raise TargetExistsError(f"{out} is inside {inside}: {tool} never writes into a checkpoint or a run's "
                                f"folders (it would alter or break them); choose a {option} outside the run")
    if is_run(here) and (checkpoint or os.path.lexists(out) or out.name.startswith(".")):
        what = "a checkpoint" if checkpoint else "a file of the run" if os.path.lexists(out) else "a hidden file"
        raise TargetExistsError(f"{out} would be {what} in the run {here}: {tool} never adds checkpoints to a run "
                                f"nor replaces its files; choose a {option} outside the run")
