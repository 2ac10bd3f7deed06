"""Tags: names for checkpoints (``"v1-before-lr-drop"``) that retention never deletes.

A tag given at save time is written into that checkpoint's manifest. A tag added later
goes into ``<run>/tags.json`` (``{tag: checkpoint name}``, replaced atomically), since a
committed checkpoint is never modified. A tag names one checkpoint; tagging another
moves it (the later ``tags.json`` entry wins over manifests).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

TAGS_FILE = "tags.json"
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise ValueError(f"invalid tag {tag!r}: use letters, digits and . _ + - (at most 100)")
    return tag


def load_tags(run_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The run-level tags (tag -> checkpoint name); an unreadable file counts as empty."""
    try:
        data = json.loads((Path(run_dir) / TAGS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and _TAG.match(k)}


def save_tags(run_dir: str | os.PathLike[str], tags: dict[str, str]) -> None:
    path = Path(run_dir) / TAGS_FILE
    tmp = path.with_name(f".{TAGS_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(dict(sorted(tags.items())), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def tags_by_checkpoint(run_dir: str | os.PathLike[str], manifest_tags: dict[str, list[str]]) -> dict[str, set[str]]:
    """Every checkpoint's tags: those in its manifest, moved or added by ``tags.json``."""
    run_level = load_tags(run_dir)
    out: dict[str, set[str]] = {name: {t for t in tags if t not in run_level} for name, tags in manifest_tags.items()}
    for tag, name in run_level.items():
        out.setdefault(name, set()).add(tag)
    return out
