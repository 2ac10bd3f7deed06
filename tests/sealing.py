"""Test helper: write a manifest the way an attacker who knows the format would, with a
valid self-checksum, so tests reach the checks behind it (file checksums, names, parsing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unbroken.format.manifest import TRAILER_END, TRAILER_KEY, new_hasher


def seal(text: str | bytes) -> bytes:
    """``text`` (a JSON object, without a trailer) with a valid self-checksum trailer."""
    raw = text.encode() if isinstance(text, str) else text
    raw = raw.rstrip()
    assert raw.endswith(b"}"), raw[-20:]
    prefix = raw[:-1].rstrip()
    h = new_hasher()
    h.update(prefix)
    return prefix + TRAILER_KEY + h.hexdigest().encode() + TRAILER_END


def load_doc(ckpt: Path) -> dict[str, Any]:
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc.pop("manifest_xxh3_128", None)
    return doc


def save_doc(ckpt: Path, doc: dict[str, Any]) -> None:
    doc = {k: v for k, v in doc.items() if k != "manifest_xxh3_128"}
    (ckpt / "manifest.json").write_bytes(seal(json.dumps(doc, indent=1)))


def write_text(ckpt: Path, text: str) -> None:
    (ckpt / "manifest.json").write_bytes(seal(text))
