"""``UnbrokenCheckpointIO``: Lightning's checkpoint files written and read by unbroken.

``Trainer(plugins=[UnbrokenCheckpointIO()])`` makes every checkpoint Lightning writes
(``trainer.save_checkpoint``, ``ModelCheckpoint``, ``OnExceptionCheckpoint``) an unbroken
checkpoint folder at the same path: safetensors plus JSON, no pickle, committed atomically
(written into a hidden staging folder, fsynced, renamed into place), checksummed. Reading
(``fit/validate/test(ckpt_path=...)``) verifies every file before decoding it and never
unpickles anything. ``ckpt_path`` may also be:

- a run written by :class:`~.callback.UnbrokenCallback` (or one of its checkpoints): its newest
  valid checkpoint, converted to the dict Lightning restores from (weights, optimizers,
  schedulers, loop counters with the data position, callbacks). The RNG states are not part
  of that dict: for an exact resume keep the callback in the Trainer, which restores them.
- a regular ``.ckpt`` file: read by Lightning's ``TorchCheckpointIO`` (``torch.load``, with
  Lightning's ``weights_only`` rules), so old runs still load.

Overwriting a path (``last.ckpt``) writes the new checkpoint beside it, then swaps the two
with renames: there is always a complete checkpoint at or beside the path.

Only what unbroken wrote is overwritten or removed: a committed unbroken checkpoint folder (its
``manifest.json``), or a symbolic link (unlinked, never followed: Lightning's ``save_last="link"``).
Saving over anything else (a ``.ckpt`` file of ``TorchCheckpointIO``, a user's folder) raises
:class:`~unbroken.errors.TargetExistsError`; ``remove_checkpoint`` leaves it in place with a warning.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

from ... import load, save
from ...errors import TargetExistsError, UnbrokenError
from ._compat import checkpoint_io_bases, fabric, installed

log = logging.getLogger("unbroken")
COMMIT_FILE = "manifest.json"
"""The file that makes a folder a committed unbroken checkpoint."""

RESERVED = "__unbroken__"


def stored_as(path: str) -> str:
    """Where unbroken stores the checkpoint Lightning names ``path``: a checkpoint's folder name is one plain
    component of ``[A-Za-z0-9._-]`` starting with a letter or digit, so ModelCheckpoint's
    ``epoch=3-step=28.ckpt`` is stored as ``epoch_3-step_28.ckpt`` (every other character becomes ``_``)."""
    head, sep, name = path.rstrip("/").rpartition("/")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    if not safe[:1].isalnum():
        safe = "c" + safe
    return head + sep + safe


def _is_unbroken(path: str, options: Mapping[str, Any] | None = None) -> bool:
    """A checkpoint folder (``manifest.json``) or a run (checkpoint folders inside) of unbroken."""
    if "://" in path:
        if not path.endswith((".ckpt", ".pt", ".pth")):
            return True
        fs, p = _remote(path, options)  # a ".ckpt" name this plugin saved is a checkpoint folder
        return bool(fs.exists(f"{p.rstrip('/')}/{COMMIT_FILE}"))
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return True
    return any(os.path.isfile(os.path.join(path, d, "manifest.json")) for d in os.listdir(path))


def _numbered(tree: Mapping[str, Any], name: str) -> list[Any]:
    if name in tree:
        return [tree[name]]
    out, i = [], 0
    while f"{name}_{i}" in tree:
        out.append(tree[f"{name}_{i}"])
        i += 1
    return out


def to_lightning(tree: Mapping[str, Any], version: str) -> dict[str, Any]:
    """A checkpoint of :class:`~.callback.UnbrokenCallback` as the dict Lightning's ``ckpt_path`` restores.
    Runs saved under ``FSDPStrategy`` or ``DeepSpeedStrategy`` hold their state in unbroken's own layout
    (sharded per parameter), which Lightning's loaders do not read: refused."""
    if "engine" in tree or (isinstance(tree.get("model"), Mapping) and "format" in tree["model"]):
        raise UnbrokenError(
            "this run was saved by UnbrokenCallback under FSDPStrategy or DeepSpeedStrategy, whose state unbroken "
            "keeps per parameter, sharded, in a layout Lightning's ckpt_path loaders do not read: resume it with "
            "UnbrokenCallback in the Trainer and fit() without ckpt_path (it resumes by itself, at any world size)")
    progress = dict((tree.get(RESERVED) or {}).get("progress") or {})
    out: dict[str, Any] = {
        "epoch": progress.get("epoch", 0), "global_step": progress.get("step", 0),
        "pytorch-lightning_version": version, "state_dict": tree["model"], "loops": dict(tree["loops"]),
        "optimizer_states": _numbered(tree, "optimizer"), "lr_schedulers": _numbered(tree, "scheduler"),
        "callbacks": dict(tree.get("callbacks") or {}),
    }
    if "scaler" in tree:
        out["native_amp_scaling_state"] = tree["scaler"]
    return out


class UnbrokenCheckpointIO(*checkpoint_io_bases()):  # type: ignore[misc]  # of each installed Lightning
    """Lightning ``CheckpointIO`` plugin: pickle-free, atomic, verified checkpoints (see the module docstring).

    A ``CheckpointIO`` of every installed Lightning: a ``Trainer`` from ``lightning.pytorch`` or
    from ``pytorch_lightning`` takes it in ``plugins=``.

    Args:
        storage_options: for URL paths (``s3://...``): endpoint, credentials (never recorded).
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options) if storage_options else None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = stored_as(os.fspath(path))
        opts = storage_options if isinstance(storage_options, Mapping) else self.storage_options
        step = checkpoint.get("global_step", 0)
        step = step if isinstance(step, int) and step >= 0 else 0
        if "://" in path:
            fs, p = _remote(path, opts)
            if fs.exists(p):
                if not fs.exists(f"{p.rstrip('/')}/{COMMIT_FILE}"):
                    raise _not_ours(path)
                fs.rm(p, recursive=True)
            save(path, checkpoint, step=step, storage_options=opts)
            return
        if not os.path.lexists(path):
            save(path, checkpoint, step=step, storage_options=opts)
            return
        if not _ours(path):
            raise _not_ours(path)
        parent, name = os.path.split(os.path.abspath(path))
        new, old = os.path.join(parent, f"{name}.unbroken-new"), os.path.join(parent, f"{name}.unbroken-old")
        for leftover in (new, old):
            if os.path.lexists(leftover) and not _ours(leftover):
                raise _not_ours(leftover)
            _remove_local(leftover)
        save(new, checkpoint, step=step)  # complete and committed before the old one is touched
        os.replace(path, old) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        os.replace(new, path)
        _remove_local(old)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = os.fspath(path)
        if not os.path.isfile(path) and "://" not in path:
            path = stored_as(path)
        if not _is_unbroken(path, self.storage_options):
            torch_io = fabric(installed()[0]).plugins.TorchCheckpointIO()
            return torch_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        tree = load(path, storage_options=self.storage_options)
        if RESERVED in tree and "loops" in tree and ("model" in tree or "engine" in tree):  # by UnbrokenCallback
            return to_lightning(tree, installed()[0].__version__)
        return tree

    def remove_checkpoint(self, path: Any) -> None:
        path = stored_as(os.fspath(path))
        if "://" in path:
            fs, p = _remote(path, self.storage_options)
            if fs.exists(f"{p.rstrip('/')}/{COMMIT_FILE}"):
                fs.rm(p, recursive=True)
            elif fs.exists(p):
                log.warning("not removing %s: it is not an unbroken checkpoint (no %s), and unbroken removes only "
                            "what it wrote", path, COMMIT_FILE)
            return
        if os.path.lexists(path) and not _ours(path):
            log.warning("not removing %s: it is not an unbroken checkpoint (no %s), and unbroken removes only "
                        "what it wrote", path, COMMIT_FILE)
            return
        _remove_local(path)

    def teardown(self) -> None:
        pass


def _ours(path: str) -> bool:
    """What this plugin may replace or remove: a link (only the link goes), or a committed unbroken
    checkpoint folder (its ``manifest.json``)."""
    return os.path.islink(path) or (os.path.isdir(path) and os.path.isfile(os.path.join(path, COMMIT_FILE)))


def _not_ours(path: str) -> TargetExistsError:
    return TargetExistsError(
        f"{path} exists and is not an unbroken checkpoint (no {COMMIT_FILE}: a torch .ckpt file, or files that "
        "unbroken did not write): UnbrokenCheckpointIO never overwrites or removes it. Move it away, or give "
        "ModelCheckpoint another dirpath or filename")


def _remote(path: str, options: Mapping[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(path, **(options or {}))


def _remove_local(path: str) -> None:
    """Remove one of this plugin's checkpoints (see :func:`_ours`): a link is unlinked, never followed."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)

