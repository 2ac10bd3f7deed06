"""``unbroken export``: a checkpoint's model weights as a safetensors file, or an HF model folder.

The weights are one part of the saved state (``model`` by default): a module's state dict,
a flat mapping of names to tensors, or the state of a DeepSpeed engine (any ZeRO stage, also one
imported from a DeepSpeed checkpoint; the default when the state has no ``model`` and one engine):
its module's weights rebuilt from the fp32 masters every rank saved a piece of
(:func:`engine_weights`). They are verified on read like any load, optionally cast
(floating-point tensors only: ``bfloat16``, ``float16``, ``float32``), and written as

* ``--to model.safetensors``: one safetensors file, loadable with ``safetensors.torch.load_file``
  and ``model.load_state_dict``;
* ``--to DIR --format hf``: ``DIR/model.safetensors`` plus ``DIR/config.json`` (a file given
  with ``--config``, else the checkpoint's HF config: :func:`hf_config`), the layout
  ``from_pretrained(DIR)`` reads.

* ``--to DIR --format checkpoint``: the whole checkpoint (every part, every rank, its manifest)
  as a self-contained unbroken checkpoint folder: the chunks an incremental checkpoint shares
  with the rest of its run are written into it as ordinary tensor files (format version 2), so
  ``unbroken verify DIR`` and ``unbroken.load(DIR)`` need nothing else (:func:`export_checkpoint`).

Tensors that share memory (tied weights) are written once each as separate copies, since
safetensors cannot store aliases; ``from_pretrained`` ties them again.

Export never destroys what it did not write (:func:`unbroken.checkpoint.targets.check_target`): an existing target
file (or,
for ``hf``, an existing ``model.safetensors``/``config.json`` in the folder) is refused unless
``force=True`` (``--force``), which replaces it by an atomic rename; a link at the target is
replaced, never written through; a folder is never replaced (``--format checkpoint`` needs a new
one); and nothing is written inside a checkpoint folder or a run, with or without ``force``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..api import load
from ..checkpoint.targets import check_target
from ..errors import TargetExistsError, UnbrokenError
from ..store.local import fsync_dir, write_file_atomic

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def weights_of(tree: Mapping[str, Any], key: str | None = None) -> dict[str, torch.Tensor]:
    """The flat name → tensor mapping at ``tree[key]`` (nested dicts joined with dots). A DeepSpeed
    engine's state (:func:`is_engine_state`) gives its module's weights (:func:`engine_weights`).
    ``key=None``: ``model``, or else the one DeepSpeed engine the tree holds."""
    if key is None:
        engines = [k for k, v in tree.items() if is_engine_state(v)]
        key = "model" if "model" in tree or len(engines) != 1 else engines[0]
    if key not in tree:
        candidates = [k for k, v in tree.items() if isinstance(v, dict) and _flat(v)]
        raise UnbrokenError(f"the checkpoint has no part {key!r}; parts with tensors: {candidates or 'none'} "
                            "(choose one with --key)")
    flat = engine_weights(tree[key]) if is_engine_state(tree[key]) else _flat(tree[key])
    if not flat:
        raise UnbrokenError(f"the checkpoint's part {key!r} holds no tensors")
    return flat


HF_INTEGRATION_CONFIG = ("trainer", "model_config")
"""Where :mod:`unbroken.integrations.hf` saves the model's config (``TrainerCounters``' ``MODEL_CONFIG``)."""


def hf_config(tree: Mapping[str, Any]) -> dict[str, Any] | None:
    """The HF model config a checkpoint records: its ``config`` part (``unbroken import`` of an HF
    Trainer folder), or the one the HF integration saves with the Trainer's counters
    (:data:`HF_INTEGRATION_CONFIG`); ``None`` if it has neither."""
    found = tree.get("config")
    if isinstance(found, dict):
        return found
    part, key = HF_INTEGRATION_CONFIG
    found = tree.get(part, {}).get(key) if isinstance(tree.get(part), dict) else None
    return found if isinstance(found, dict) else None


def is_engine_state(value: Any) -> bool:
    """True for the saved state of a DeepSpeed engine (:class:`unbroken.dist.deepspeed.DeepSpeedState`,
    or an ``unbroken import`` of a DeepSpeed checkpoint), recognised by its layout."""
    from ..dist.deepspeed import FORMAT

    if not isinstance(value, dict) or value.get("format") != FORMAT:
        return False
    if value.get("mode") == "plain":
        return "module" in value
    return value.get("mode") in ("hp", "zero3") and {"params", "master", "frozen"} <= set(value)


def engine_weights(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The module weights of a DeepSpeed engine's saved state, named as the module's ``state_dict``:
    each trainable parameter from its fp32 master (assembled from every rank's pieces), reshaped and
    cast to the parameter's dtype, as DeepSpeed derives it after a step; frozen ones and buffers as saved."""
    if state["mode"] == "plain":  # ZeRO stage 0: the module's own state dict
        return _flat(state["module"])
    out: dict[str, torch.Tensor] = {}
    for name, info in state["params"].items():
        part = "master" if info.get("trainable", True) else "frozen"
        src = state[part].get(name)
        if not isinstance(src, torch.Tensor):
            raise UnbrokenError(f"the DeepSpeed engine's state has no {part} tensor for {name!r}: the checkpoint "
                                "is incomplete")
        dtype = getattr(torch, str(info["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise UnbrokenError(f"the DeepSpeed engine's state names the dtype {info['dtype']!r} for {name!r}")
        out[name] = src.reshape([int(s) for s in info["shape"]]).to(dtype)
    out.update(_flat(state.get("buffers") or {}))
    return out


def _flat(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def export_checkpoint(checkpoint: str | os.PathLike[str], to: str | os.PathLike[str], *,
                      storage_options: Mapping[str, Any] | None = None) -> Path:
    """Copy ``checkpoint`` (or a run's newest valid one) to the new folder ``to`` as a
    self-contained checkpoint: every file and chunk verified, chunk maps replaced by the tensor
    files they stand for, the manifest rewritten (format 2, same step, seq, metrics,
    environment), committed atomically. Returns ``to``."""
    from dataclasses import replace

    from ..api import is_run, read_run
    from ..checkpoint.persist import commit, write_blob, write_tensors
    from ..checkpoint.reader import verify_all
    from ..format import chunkmap
    from ..format.manifest import FileEntry, Manifest, is_chunk
    from ..format.tensorfile import TensorEntry
    from ..store import open_store, split_checkpoint

    out = Path(to)
    if os.path.lexists(out):
        raise TargetExistsError(f"{out} exists: --format checkpoint writes a new folder and never replaces one "
                                "(not even with --force); remove it yourself or choose another --to")
    check_target(out, force=False, folder=True, checkpoint=True)
    if is_run(checkpoint, storage_options):
        store, name = open_store(checkpoint, storage_options, readonly=True), read_run(checkpoint, storage_options).name
    else:
        store, name = split_checkpoint(checkpoint, storage_options)
    loaded = verify_all(store, name)  # every file and chunk checked before anything is written
    manifest: Manifest = loaded.manifest
    files = loaded.files
    assert files is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = open_store(out.parent).stage(out.name)
    try:
        written: dict[str, FileEntry] = {}
        for fname in sorted(manifest.files):
            if is_chunk(fname):
                continue
            if fname.endswith(chunkmap.SUFFIX):
                tfile = chunkmap.tensor_file_of(fname)
                entries = [TensorEntry(k, t) for k, t in files.tensors(tfile).items()]
                written[tfile] = write_tensors(staging, tfile, entries)
            else:
                written[fname] = write_blob(staging, fname, bytes(files.read(fname)))
        final, _ = commit(staging, **vars(replace(manifest, files=written, format_version=2)))
    except BaseException:
        staging.abort()
        raise
    if final != out.name:  # another process created the folder meanwhile
        raise UnbrokenError(f"{out} appeared while exporting; the export is at {out.parent / final}")
    return out


def export_weights(checkpoint: str | os.PathLike[str], to: str | os.PathLike[str], *, key: str | None = None,
                   dtype: str | None = None, fmt: str = "safetensors", config: str | os.PathLike[str] | None = None,
                   storage_options: Mapping[str, Any] | None = None, force: bool = False) -> list[Path]:
    """Write the weights of ``checkpoint`` (one checkpoint, or a run: its newest valid one) to
    ``to``; return the files written. See the module docstring for ``fmt`` and ``dtype``;
    ``force``: replace an existing target file (never a folder, never inside a checkpoint or run);
    ``key``: the part holding the weights (see :func:`weights_of`)."""
    from safetensors.torch import save

    if fmt == "checkpoint":
        if dtype is not None:
            raise UnbrokenError("--dtype does not apply to --format checkpoint (an exact copy)")
        return [export_checkpoint(checkpoint, to, storage_options=storage_options)]
    if fmt not in ("safetensors", "hf"):
        raise UnbrokenError(f"unknown export format {fmt!r}: use 'safetensors', 'hf' or 'checkpoint'")
    if dtype is not None and dtype not in DTYPES:
        raise UnbrokenError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
    out = Path(to)
    targets = [out] if fmt == "safetensors" else [out / "model.safetensors", out / "config.json"]
    check_target(out, force=force, folder=fmt == "hf")  # before the (slow) read: nothing is read in vain
    for target in targets if fmt == "hf" else []:
        check_target(target, force=force, folder=False)
    tree = load(checkpoint, storage_options=storage_options)
    weights = weights_of(tree, key)
    cast = DTYPES[dtype] if dtype else None
    tensors = {name: (t.to(cast) if cast is not None and t.is_floating_point() else t).contiguous().clone()
               for name, t in weights.items()}
    model_config = hf_config(tree)
    del tree, weights  # the clones are what is written: at most two copies of the weights in memory
    metadata = {"format": "pt", "exported_by": "unbroken", "source": os.fspath(checkpoint)}
    if fmt == "hf":
        if config is not None:
            config_bytes = Path(config).read_bytes()
        elif isinstance(model_config, dict):
            config_bytes = (json.dumps(model_config, indent=2, sort_keys=True) + "\n").encode()
        else:
            raise UnbrokenError("the checkpoint records no HF model config (no 'config' part, as an HF import has, "
                                "and not written by unbroken.integrations.hf): pass --config config.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        out.mkdir(exist_ok=True)
        check_target(out, force=force, folder=True)  # a link planted meanwhile is not written through
    write_file_atomic(targets[0], save(tensors, metadata=metadata), sync_dir=False)
    if fmt == "hf":
        write_file_atomic(targets[1], config_bytes, sync_dir=False)
    fsync_dir(targets[0].parent)
    return targets
