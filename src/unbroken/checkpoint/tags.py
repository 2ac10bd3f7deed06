"""Tags: names for checkpoints (``"v1-before-lr-drop"``) that retention never deletes.

A tag given at save time is written into that checkpoint's manifest. A tag added later
goes into the run-level file ``tags.json`` (``{tag: checkpoint name}``, replaced
atomically through the store), since a committed checkpoint is never modified. A tag
names one checkpoint; tagging another moves it (the later ``tags.json`` entry wins over
manifests).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from ..errors import UnbrokenError

log = logging.getLogger("unbroken")

TAGS_FILE = "tags.json"
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise ValueError(f"invalid tag {tag!r}: use letters, digits and . _ + - (at most 100)")
    return tag


def read_tags(store: Any) -> tuple[dict[str, str], str | None]:
    """The run-level tags (tag -> checkpoint name), and why ``tags.json`` could not be read (``None``:
    read, or absent). Unreadable, it counts as empty for listing, but retention deletes nothing while
    it is (:func:`retention_blocked`): the tags it held are unknown."""
    try:
        raw = store.read_meta(TAGS_FILE)
        data = json.loads(raw) if raw is not None else {}
    except (OSError, ValueError, RecursionError, UnbrokenError) as e:  # a link, a FIFO, 1 GB, not JSON
        return {}, f"{type(e).__name__}: {e}"
    if not isinstance(data, dict):
        return {}, f"not a JSON object but {type(data).__name__}"
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and _TAG.match(k)}, None


def load_tags(store: Any) -> dict[str, str]:
    """The run-level tags (tag -> checkpoint name); an unreadable file counts as empty (with a warning)."""
    tags, problem = read_tags(store)
    if problem is not None:
        log.warning("ignoring the run's %s: %s", TAGS_FILE, problem)
    return tags


def retention_blocked(store: Any) -> str | None:
    """Why retention must delete nothing in ``store`` now: its ``tags.json`` exists but cannot be
    read, so which checkpoints it protects is unknown (``None``: retention may go on)."""
    problem = read_tags(store)[1]
    if problem is None:
        return None
    return (f"the run's {TAGS_FILE} in {store.url} cannot be read ({problem}), so the checkpoints it tags are "
            f"unknown: retention deletes nothing until it is fixed or removed (`unbroken tag` rewrites it)")


def save_tags(store: Any, tags: dict[str, str]) -> None:
    store.write_meta(TAGS_FILE, json.dumps(dict(sorted(tags.items())), indent=1).encode())


def tags_by_checkpoint(store: Any, manifest_tags: dict[str, list[str]]) -> dict[str, set[str]]:
    """Every checkpoint's tags: those in its manifest, moved or added by ``tags.json``."""
    run_level = load_tags(store)
    out: dict[str, set[str]] = {name: {t for t in tags if t not in run_level} for name, tags in manifest_tags.items()}
    for tag, name in run_level.items():
        out.setdefault(name, set()).add(tag)
    return out


def sync_tags(store: Any, remote: Any, uploaded: Mapping[str, str]) -> None:
    """Copy ``store``'s run-level tags to the ``remote`` tier, mapped to the names there
    (``uploaded``: local name -> remote name)."""
    if store.read_meta(TAGS_FILE) is None:
        return
    save_tags(remote, {t: uploaded.get(n, n) for t, n in load_tags(store).items()})
