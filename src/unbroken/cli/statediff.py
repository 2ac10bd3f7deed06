"""The comparison behind ``unbroken diff``: two decoded checkpoints walked side by side.

Both checkpoints are verified and decoded (never unpickled); their state trees are walked
side by side. Tensors (and numpy arrays) are compared bitwise first; for those that
differ the report gives the largest absolute difference and the relative norm
``||a-b|| / ||a||`` (in float64; NaN equals NaN, a NaN on one side only counts as an
infinite difference). Tensors with another dtype or shape, entries on one side only and
plain values that differ are listed by their path in the tree (``optimizer/state/0/exp_avg``;
rank 0's own part, its RNG states, under ``(rank 0)/``). RNG streams (the global generators
a Checkpointer saves, and generator objects anywhere in the state) are compared whole, by
state, and those nothing drew from are set apart (:mod:`.rngdiff`). Then the step, progress,
metrics, kind and world size of the manifests, and the environments
(:func:`unbroken.checkpointer.environment.diff`).

*Identical* means: no tensor, value, counted RNG stream or manifest field differs and no
*significant* environment field does (code, versions, config, data, world size); *info*
fields (host, argv, platform) and RNG streams never drawn from are shown but not counted.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..api import read_path
from ..checkpointer.environment import MISSING
from ..checkpointer.environment import diff as environment_diff
from ..format.manifest import Manifest
from ..state.codec import StatefulValue
from .base import options_for
from .rngdiff import RngDiff, classify, streams

RANK_PART = "(rank 0)"


@dataclass
class TensorDiff:
    """A tensor present on both sides that is not bitwise identical."""

    path: str
    dtype: str
    shape: list[int]
    problem: str = ""
    """``""`` (values differ), ``"dtype"`` or ``"shape"`` (then ``other`` is B's dtype or shape)."""
    other: Any = None
    max_abs_diff: float | None = None
    rel_norm: float | None = None


@dataclass
class Report:
    """Everything ``unbroken diff`` found."""

    identical_tensors: int = 0
    tensors: list[TensorDiff] = field(default_factory=list)
    only_in_a: list[dict[str, str]] = field(default_factory=list)
    only_in_b: list[dict[str, str]] = field(default_factory=list)
    values: list[dict[str, Any]] = field(default_factory=list)
    identical_rng: int = 0
    rng: list[RngDiff] = field(default_factory=list)
    """RNG streams that are not the same on both sides; those with ``counted`` False are never
    drawn from (or absent) on each side and do not make the checkpoints differ."""
    manifest: list[dict[str, Any]] = field(default_factory=list)
    environment: list[dict[str, Any]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.differs_in_state or self.manifest
                    or any(c["severity"] == "significant" for c in self.environment))

    @property
    def differs_in_state(self) -> bool:
        """Whether the state trees differ (tensors, values, entries, counted RNG streams)."""
        return bool(self.tensors or self.only_in_a or self.only_in_b or self.values
                    or any(r.counted for r in self.rng))


def _as_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray) and x.dtype.kind in "biufc":
        return torch.from_numpy(np.ascontiguousarray(x))
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return (torch.view_as_real(t) if t.is_complex() else t).to(torch.float64).reshape(-1)


def tensor_diff(path: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff | None:
    """How ``b`` differs from ``a``; ``None`` if they are bitwise identical."""
    dtype = str(a.dtype).removeprefix("torch.")
    if a.dtype != b.dtype:
        return TensorDiff(path, dtype, list(a.shape), "dtype", str(b.dtype).removeprefix("torch."))
    if a.shape != b.shape:
        return TensorDiff(path, dtype, list(a.shape), "shape", list(b.shape))
    if torch.equal(_bits(a), _bits(b)):
        return None
    x, y = _float64(a), _float64(b)
    same = (x == y) | (x.isnan() & y.isnan())
    d = torch.where(same, torch.zeros_like(x), (x - y).abs()).nan_to_num(nan=math.inf)
    norm_a = torch.linalg.vector_norm(x.nan_to_num(nan=0.0)).item()
    norm_d = torch.linalg.vector_norm(d).item()
    rel = norm_d / norm_a if norm_a > 0 and math.isfinite(norm_a) else (0.0 if norm_d == 0 else math.inf)
    return TensorDiff(path, dtype, list(a.shape), max_abs_diff=d.max().item() if d.numel() else 0.0, rel_norm=rel)


def same_value(a: Any, b: Any) -> bool:
    """Plain values equal, and of the same type; floats bitwise (NaN equals NaN, 0.0 differs from -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd type whose == does not give a truth value
        return repr(a) == repr(b)


def _describe(x: Any) -> str:
    t = _as_tensor(x)
    return f"tensor {str(t.dtype).removeprefix('torch.')} {list(t.shape)}" if t is not None else type(x).__name__


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def same_tree(a: Any, b: Any) -> bool:
    """Whether two decoded values are identical by :func:`compare_trees`' rules (bitwise)."""
    scratch = Report()
    compare_trees(a, b, scratch)
    return not scratch.differs_in_state


def compare_rng(a: dict[str, tuple[str, Any]], b: dict[str, tuple[str, Any]], report: Report, path: str) -> None:
    """Compare the RNG streams of two generators (or of two global-RNG parts) stream by stream."""
    for name in [*a, *(k for k in b if k not in a)]:
        where = _join(path, name) if name else path
        if name in a and name in b and same_tree(a[name][1], b[name][1]):
            report.identical_rng += 1
        else:
            report.rng.append(classify(where, a.get(name), b.get(name)))


def compare_trees(a: Any, b: Any, report: Report, path: str = "") -> None:
    """Walk two decoded state trees side by side and add every difference to ``report``."""
    ta, tb = _as_tensor(a), _as_tensor(b)
    ra, rb = streams(a), streams(b)
    if ta is not None and tb is not None:
        found = tensor_diff(path, ta, tb)
        if found is None:
            report.identical_tensors += 1
        else:
            report.tensors.append(found)
    elif ra is not None and rb is not None:
        compare_rng(ra, rb, report, path)
    elif isinstance(a, StatefulValue) and isinstance(b, StatefulValue):
        if a.cls != b.cls:
            report.values.append({"path": _join(path, "@class"), "a": a.cls, "b": b.cls})
        compare_trees(a.value, b.value, report, path)
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            where = _join(path, key)
            if key not in b:
                _one_sided(a[key], where, report, "a")
            elif key not in a:
                _one_sided(b[key], where, report, "b")
            else:
                compare_trees(a[key], b[key], report, where)
    elif isinstance(a, (list, tuple)) and type(a) is type(b):
        for i in range(max(len(a), len(b))):
            if i >= len(b):
                _one_sided(a[i], _join(path, i), report, "a")
            elif i >= len(a):
                _one_sided(b[i], _join(path, i), report, "b")
            else:
                compare_trees(a[i], b[i], report, _join(path, i))
    elif not same_value(a, b):
        report.values.append({"path": path or "/", "a": a, "b": b})


def _one_sided(x: Any, path: str, report: Report, where: str) -> None:
    """An entry only one side has: an RNG stream (never drawn from there: not counted), or any other."""
    found = streams(x)
    if found is not None and "" in found:  # a generator object
        report.rng.append(classify(path, found[""] if where == "a" else None, found[""] if where == "b" else None))
    elif found is not None:  # a global-RNG part: stream by stream
        for name, stream in found.items():
            report.rng.append(classify(_join(path, name), stream if where == "a" else None,
                                       stream if where == "b" else None))
    else:
        (report.only_in_a if where == "a" else report.only_in_b).append({"path": path, "what": _describe(x)})


def compare_manifests(a: Manifest, b: Manifest, report: Report) -> None:
    """Step, kind, world size, progress and metrics; then the environments."""
    fields = {"step": (a.step, b.step), "kind": (a.kind, b.kind), "world_size": (a.world_size, b.world_size)}
    for group, (x, y) in {"progress": (a.progress, b.progress), "metrics": (a.metrics, b.metrics)}.items():
        for key in [*x, *(k for k in y if k not in x)]:
            fields[f"{group}.{key}"] = (x.get(key, MISSING), y.get(key, MISSING))
    report.manifest += [{"field": f, "a": x, "b": y} for f, (x, y) in fields.items() if not same_value(x, y)]
    report.environment += [{"field": c.field, "a": c.saved, "b": c.current, "severity": c.severity}
                           for c in environment_diff(a.environment, b.environment)]


def diff_checkpoints(path_a: str, path_b: str) -> tuple[Report, Manifest, Manifest]:
    """Verify, decode and compare two checkpoints (raises the library's errors)."""
    loaded = [read_path(p, options_for(p)) for p in (path_a, path_b)]
    report = Report()
    compare_manifests(loaded[0].manifest, loaded[1].manifest, report)
    trees = [{**x.materialize(), **({RANK_PART: x.rank_state} if x.rank_state is not None else {})} for x in loaded]
    compare_trees(trees[0], trees[1], report)
    return report, loaded[0].manifest, loaded[1].manifest
