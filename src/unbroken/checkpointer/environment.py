"""The environment a checkpoint was written in (:func:`fingerprint`, JSON-safe, stored in
every manifest's ``environment``) and what changed since (:func:`diff`, :func:`check`).

- *Significant* changes can alter a resumed run's numbers: the code (git commit, dirty,
  diff hash), versions of python/torch/numpy/CUDA/cuDNN/unbroken and the key packages,
  config, data, world size. The rest is *info*: host, platform, argv, rank, GPU names,
  git branch, safetensors/xxhash (file format only). A top-level key missing on one side
  was not recorded by an older unbroken: info, so old checkpoints still restore. ``rank``
  is recorded but not compared: every rank reads the manifest one rank wrote.
- ``dirty`` counts tracked files only (``git diff HEAD``): a run folder inside the
  repository would otherwise make every run dirty.
- Config values must be JSON-like. Numpy scalars and 0-d arrays/tensors become numbers;
  paths, enums, dtypes and devices strings; tuples and sets lists; dataclasses and
  ``argparse.Namespace`` dicts; nan/inf the strings ``"nan"``/``"inf"``/``"-inf"``. Other
  objects raise :class:`TypeError` naming their path: a ``repr`` may hold a memory address.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.metadata
import json
import logging
import math
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .. import __version__
from ..errors import EnvironmentMismatchError

log = logging.getLogger("unbroken")

KEY_PACKAGES = ("torchvision", "transformers", "accelerate", "lightning", "torchdata")
MAX_DATA_FILES = 10_000
GIT_TIMEOUT_S = 5.0
POLICIES = ("ignore", "warn", "strict")
MAX_LINES = 50
_SIGNIFICANT = ("git.commit", "git.dirty", "git.diff_hash", "python", "torch", "numpy", "cuda",
                "cudnn", "unbroken", "packages", "config", "data", "world_size")
_NOT_COMPARED = ("rank",)


@dataclass(frozen=True)
class EnvCheck:
    """What a :class:`~unbroken.Checkpointer` records about the environment, and what a resume
    does about differences.

    Args:
        config: your hyperparameters (a JSON-like dict), recorded in every manifest.
        data: a dataset identifier (a string), or paths whose sizes and mtimes are recorded.
        policy: on restore, compare the saved environment (code, versions, config, data,
            world size) with this one: ``"warn"`` logs the differences, ``"strict"`` refuses
            with :class:`EnvironmentMismatchError` before anything is loaded, ``"ignore"``.
    """

    config: Mapping[str, Any] | None = None
    data: Any = None
    policy: str = "warn"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"EnvCheck policy must be one of {POLICIES}, not {self.policy!r}")
        if self.config is not None:
            json_safe_config(self.config)  # a TypeError naming the bad key now, not at the first save


class _Missing:  # type of MISSING: a Change's saved/current when that side lacks the key
    def __repr__(self) -> str:
        return "(absent)"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class Change:
    """One difference between a recorded and the current fingerprint."""

    field: str  #: dotted path, e.g. ``"config.lr"``, ``"git.commit"``, ``"torch"``
    saved: Any  #: value in the checkpoint, or :data:`MISSING`
    current: Any  #: value now, or :data:`MISSING`
    severity: str  #: ``"significant"`` or ``"info"``

    def __str__(self) -> str:
        return f"{self.field}: {_show(self.saved)} -> {_show(self.current)}"


def fingerprint(config: Mapping[str, Any] | object | None = None, data: Any = None, *,
                cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The current environment as a JSON-safe dict (see the module docstring).

    ``config``: the hyperparameters (mapping, dataclass or ``argparse.Namespace``).
    ``data``: a dataset id (``str``; ``bytes`` are recorded as hex), or a path
    (``os.PathLike``) or list of paths: see :func:`data_fingerprint`. A plain ``str`` is
    always an id, never a path. ``cwd``: where to run git (default: the current directory).
    """
    world = _world()
    env: dict[str, Any] = {
        "unbroken": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": _version("safetensors"),
        "xxhash": _version("xxhash"),
        "packages": {n: v for n in KEY_PACKAGES if (v := _version(n)) is not None},
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "argv": list(sys.argv),
        "world_size": world[0],
        "rank": world[1],
        "git": git_state(os.getcwd() if cwd is None else cwd),
        "config": None if config is None else json_safe_config(config),
        "data": None if data is None else data_fingerprint(data),
    }
    return json.loads(json.dumps(env, allow_nan=False))  # exactly what a manifest round-trips to


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def git_state(cwd: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``{commit, branch, dirty, diff_hash}`` of the repository at ``cwd``, or ``None``
    when git is missing, ``cwd`` is not in a work tree, HEAD has no commit yet, or git
    fails or takes longer than :data:`GIT_TIMEOUT_S`. ``diff_hash`` is the xxh3-128 of
    ``git diff HEAD --binary`` (staged and unstaged changes to tracked files), ``None``
    when that diff is empty."""
    try:
        head = _git(cwd, "rev-parse", "HEAD", "--abbrev-ref", "HEAD").decode().split()
        patch = _git(cwd, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--no-textconv")
    except Exception as e:  # noqa: BLE001 - the fingerprint must never break a save or a restore
        log.debug("no git state for %s: %s", cwd, e)
        return None
    return None if len(head) != 2 else {
        "commit": head[0], "branch": None if head[1] == "HEAD" else head[1],
        "dirty": bool(patch), "diff_hash": xxhash.xxh3_128_hexdigest(patch) if patch else None}


def _git(cwd: str | os.PathLike[str], *args: str) -> bytes:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")  # never take the user's index lock
    return subprocess.run(["git", "-c", "core.fsmonitor=false", *args], cwd=cwd, env=env,
                          capture_output=True, check=True, timeout=GIT_TIMEOUT_S,
                          stdin=subprocess.DEVNULL).stdout


def json_safe_config(config: Any) -> dict[str, Any]:
    """``config`` (a mapping, dataclass or ``argparse.Namespace``) as a JSON-safe dict."""
    out = _safe(vars(config) if isinstance(config, argparse.Namespace) else config, "config", 0)
    if not isinstance(out, dict):
        raise TypeError(f"config must be a mapping, a dataclass or an argparse.Namespace, "
                        f"not {type(config).__name__}")
    return out


def _safe(v: Any, where: str, depth: int) -> Any:
    if depth > 32:
        raise TypeError(f"{where} is nested too deeply (a cycle?)")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, (int, float)):  # bool, str, Enum (IntEnum too) are handled above
        return int(v) if isinstance(v, int) else float(v) if math.isfinite(v) else repr(float(v))
    if isinstance(v, np.generic) or (isinstance(v, (np.ndarray, torch.Tensor)) and v.ndim == 0):
        return _safe(v.item(), where, depth + 1)
    if isinstance(v, (os.PathLike, torch.dtype, torch.device)):
        return os.fspath(v) if isinstance(v, os.PathLike) else str(v)
    if isinstance(v, Mapping):
        out: dict[str, Any] = {}
        for k, x in v.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"{where} has a key of type {type(k).__name__}; use str keys")
            if str(k) in out:
                raise TypeError(f"{where} has two keys that both read {str(k)!r}")
            out[str(k)] = _safe(x, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(v, (list, tuple)):
        return [_safe(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, (set, frozenset)):
        items = [_safe(x, f"{where}{{...}}", depth + 1) for x in v]
        return sorted(items, key=lambda x: json.dumps(x, sort_keys=True))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _safe({f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, where, depth)
    raise TypeError(f"{where} is a {type(v).__name__}, which has no stable JSON form; "
                    f"record a plain value instead (a number, string, list or dict, e.g. str(value))")


def data_fingerprint(data: Any) -> dict[str, Any]:
    """``{"hash": id}`` for a ``str``/``bytes`` id; for paths, ``{"files": [{path, size,
    mtime}], "count", "truncated", "hash"}`` with the xxh3-128 of the file list. A path
    that does not exist is listed with ``size`` and ``mtime`` ``None``."""
    if isinstance(data, (str, bytes, bytearray)):
        return {"hash": data if isinstance(data, str) else bytes(data).hex()}
    data = [data] if isinstance(data, os.PathLike) else data
    if not isinstance(data, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in data):
        raise TypeError("data must be a str or bytes id, a path, or a list of paths, "
                        f"not {type(data).__name__}")
    files: list[dict[str, Any]] = []
    truncated = False
    for path in _walk(os.fspath(p) for p in data):
        if truncated := len(files) == MAX_DATA_FILES:
            break
        try:
            st = os.stat(path)
            files.append({"path": path, "size": st.st_size, "mtime": st.st_mtime})
        except OSError:
            files.append({"path": path, "size": None, "mtime": None})
    blob = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return {"files": files, "count": len(files), "truncated": truncated,
            "hash": xxhash.xxh3_128_hexdigest(blob)}


def _walk(paths: Iterable[str]) -> Iterable[str]:
    """Each path, or a directory's files in sorted order (symlinked subfolders not followed)."""
    for top in paths:
        if not os.path.isdir(top):
            yield top
        for root, dirs, names in os.walk(top):  # yields nothing for a non-directory
            dirs.sort()
            yield from (os.path.join(root, name) for name in sorted(names))


def diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[Change]:
    """Every difference between two fingerprints, nested dicts compared key by key."""
    out: list[Change] = []
    _compare(saved, current, "", out)
    return out


def _compare(a: Any, b: Any, where: str, out: list[Change]) -> None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            path = f"{where}.{key}" if where else str(key)
            if path in _NOT_COMPARED:
                continue
            if key not in a or key not in b:
                sev = "info" if not where else severity(path)  # top level: not recorded then
                out.append(Change(path, a.get(key, MISSING), b.get(key, MISSING), sev))
            else:
                _compare(a[key], b[key], path, out)
    elif where == "data.files" and isinstance(a, list) and isinstance(b, list):
        old, new = ({str(f.get("path")): {k: v for k, v in f.items() if k != "path"}
                     for f in x if isinstance(f, Mapping)} for x in (a, b))
        for p in sorted(set(old) | set(new)):
            if old.get(p, MISSING) != new.get(p, MISSING):
                out.append(Change(f"data.files[{p}]", old.get(p, MISSING), new.get(p, MISSING),
                                  "significant"))
    elif a != b or isinstance(a, bool) != isinstance(b, bool):  # True == 1 in Python
        out.append(Change(where, a, b, severity(where)))


def severity(field: str) -> str:
    """``"significant"`` or ``"info"`` for a dotted field path (see the module docstring)."""
    hit = field == "git" or any(field == p or field.startswith((p + ".", p + "[")) for p in _SIGNIFICANT)
    return "significant" if hit else "info"


def _show(v: Any) -> str:
    text = repr(v) if v is MISSING else v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def format_changes(changes: Iterable[Change]) -> str:
    """One line per change, significant first: ``config.lr: 0.001 -> 0.002``; at most
    :data:`MAX_LINES` lines, then a count of the rest."""
    ordered = sorted(changes, key=lambda c: c.severity != "significant")
    lines = [f"  {c}" + (" (info)" if c.severity == "info" else "") for c in ordered[:MAX_LINES]]
    if len(ordered) > MAX_LINES:
        lines.append(f"  ... and {len(ordered) - MAX_LINES} more")
    return "\n".join(lines)


def check(saved: Mapping[str, Any], current: Mapping[str, Any], policy: str = "warn") -> list[Change]:
    """Compare a checkpoint's fingerprint with the current one and apply ``policy``:
    ``"ignore"`` returns ``[]`` and logs nothing; ``"warn"`` logs the changes in one record
    on the ``unbroken`` logger (WARNING if any is significant, else INFO) and returns them;
    ``"strict"`` is "warn" but raises :class:`EnvironmentMismatchError` on significant ones."""
    if policy not in POLICIES:
        raise ValueError(f"unknown environment policy {policy!r}; use one of {', '.join(POLICIES)}")
    if policy == "ignore":
        return []
    changes = diff(saved, current)
    significant = [c for c in changes if c.severity == "significant"]
    if significant and policy == "strict":
        raise EnvironmentMismatchError(
            f"the environment differs from the one the checkpoint was written in "
            f"({len(significant)} significant change(s)), so the resumed run may not match:\n"
            f"{format_changes(significant)}\n"
            "restore that environment (check out the commit, install those versions, use the same "
            "config, data and world size), or resume anyway: Checkpointer(..., env=EnvCheck(policy='warn'))")
    if changes:
        log.log(logging.WARNING if significant else logging.INFO,
                "the environment differs from the one the checkpoint was written in "
                "(%d significant, %d info):\n%s", len(significant), len(changes) - len(significant),
                format_changes(changes))
    return changes
