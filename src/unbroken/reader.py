"""Reading a checkpoint: verify every byte, then decode, never unpickle.

Each listed file is read once into memory, its size and xxh3-128 checksum are
compared with the manifest, and only those verified bytes are parsed, so what was
checked is exactly what is loaded. Nothing outside the manifest's list is opened.
Any defect raises :class:`~unbroken.errors.CorruptCheckpointError` before a single
value reaches the live training state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptCheckpointError
from .format.manifest import MANIFEST, STATE_FILE, Manifest, new_hasher, strict_object
from .format.tensorfile import load_tensor_file
from .snapshot import TOP
from .state.decoder import Decoder
from .store.base import Store as Storage


@dataclass
class LoadedCheckpoint:
    """A verified, decoded checkpoint: its manifest and its state tree."""

    name: str
    manifest: Manifest
    state: dict[str, Any]


def read_manifest(storage: Storage, name: str) -> Manifest:
    return Manifest.from_json(bytes(storage.read(name, MANIFEST)))


def read_checkpoint(storage: Storage, name: str) -> LoadedCheckpoint:
    """Verify and decode checkpoint ``name``; raise ``CorruptCheckpointError`` on any defect."""
    try:
        manifest = read_manifest(storage, name)
        blobs: dict[str, Any] = {}
        for fname, entry in manifest.files.items():
            buf = storage.read(name, fname, entry.size)
            h = new_hasher()
            h.update(buf)
            if h.hexdigest() != entry.xxh3_128:
                raise CorruptCheckpointError(f"{fname}: checksum mismatch (the file was altered or damaged)")
            blobs[fname] = buf
        try:
            tree = json.loads(bytes(blobs[STATE_FILE]).decode("utf-8"), object_pairs_hook=strict_object)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{STATE_FILE} does not parse ({type(e).__name__})") from None
        if not isinstance(tree, dict) or not isinstance(tree.get(TOP), dict):
            raise CorruptCheckpointError(f"{STATE_FILE} has no state")
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        complex_views: dict[tuple[str, str], torch.Tensor] = {}

        def resolve(ref: dict[str, Any]) -> torch.Tensor:
            fname, key = ref["file"], ref["key"]
            if not isinstance(fname, str) or fname not in blobs or not fname.endswith(".safetensors"):
                raise CorruptCheckpointError(f"tensor reference to unlisted file {fname!r}")
            if fname not in tensors:
                tensors[fname] = load_tensor_file(blobs[fname], fname)
            if key not in tensors[fname]:
                raise CorruptCheckpointError(f"{fname} has no tensor {key!r}")
            t = tensors[fname][key]
            if not ref.get("complex"):
                return t
            # One complex view per stored tensor, so shared references stay one object.
            ckey = (fname, key)
            if ckey not in complex_views:
                complex_views[ckey] = torch.view_as_complex(t)
            return complex_views[ckey]

        decoded = Decoder(resolve).decode({"@": "dict", "v": tree[TOP]})
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{storage.describe(name)}: {e}") from None
    return LoadedCheckpoint(name=name, manifest=manifest, state=decoded)
