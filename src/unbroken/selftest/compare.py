"""Align the interrupted run's per-step records with the uninterrupted run's; find the first difference.

Every record of the interrupted run is compared, in the order they were written: each
process's ``restore`` record (the state as restored at step R) with the uninterrupted
run's record of step R, and each of its ``step`` records with the same step of the
uninterrupted run, steps re-run after a resume included. The first record that differs in
any component is the divergence; its components are listed in causal order (the data
first, then the RNG, gradients, parameters, optimizer, the rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol import records_file

EVIDENCE = ("unsaved generators",)
"""Components recorded to explain a divergence, never a divergence themselves (heuristic)."""


def load_records(folder: Path, rank: int = 0) -> list[dict[str, Any]]:
    """The records of one run (of one rank), in the order written (a line cut short by a SIGKILL is skipped)."""
    path = folder / records_file(rank)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def order(name: str) -> tuple[int, str]:
    """Causal order of components: what feeds a step before what it produces."""
    ranks = [("batch/indices", 0), ("batch/data", 1), ("batch/rng/", 2), ("/gradients", 3), ("metric/", 4),
             ("/parameters", 5), ("/buffers", 6), ("/moments:", 7), ("/hyperparameters", 8), ("rng/", 10),
             ("progress", 11)]
    for pattern, rank in ranks:
        if name.startswith(pattern) or (pattern.startswith("/") and pattern in name):
            return rank, name
    return 9, name


@dataclass
class Divergence:
    """The first record of the interrupted run that differs from the uninterrupted run."""

    step: int
    segment: int
    kind: str  # "restore": the state just restored; "step": the state at the end of a step
    resumed_from: int | None
    differ: list[str]
    agree: list[str]
    values: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    restore_differ: list[str] = field(default_factory=list)
    """Components that differed in this process's restore record (evidence included)."""
    rank: int | None = None
    """The rank whose records differ (``None``: a single process)."""

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "segment": self.segment, "record": self.kind, "resumed_from": self.resumed_from,
                "components": self.differ, "agreeing": self.agree,
                "values": {k: {"uninterrupted": a, "interrupted": b} for k, (a, b) in self.values.items()},
                "after_restore_differ": self.restore_differ}


@dataclass
class Comparison:
    compared_records: int
    compared_components: int
    rerun_steps: int
    divergence: Divergence | None
    missing_steps: list[int]
    ignored: list[str] = field(default_factory=list)
    """Global RNG streams left out: not seeded (they differ from the start) and never drawn from."""
    missing_rank: int | None = None
    """Under torchrun: the rank whose ``missing_steps`` these are."""


def _reference(ref: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """Step -> the uninterrupted run's components at the end of that step (step 0: as restored)."""
    at: dict[int, dict[str, str]] = {}
    for r in ref:
        if r.get("kind") == "restore" and r["step"] not in at:
            at[r["step"]] = r["c"]
        elif r.get("kind") == "step":
            at[r["step"]] = r["c"]
    return at


def _diff(a: dict[str, str], b: dict[str, str], keys: set[str]) -> tuple[list[str], list[str]]:
    differ = sorted((k for k in keys if a.get(k) != b.get(k)), key=order)
    agree = sorted((k for k in keys if a.get(k) == b.get(k)), key=order)
    return differ, agree


def unused_unseeded(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> list[str]:
    """Global RNG streams that differ between the runs' fresh starts (nobody seeded them: python and
    numpy seed themselves from the OS) but never change in the uninterrupted run (nothing draws from
    them): they cannot affect training, and comparing them would only report noise."""
    starts = [[r for r in rs if r.get("kind") == "restore" and r.get("seg") == 0 and r["step"] == 0][:1]
              for rs in (ref, got)]
    if not starts[0] or not starts[1]:
        return []
    a, b = starts[0][0]["c"], starts[1][0]["c"]
    out = []
    for k in sorted(a):
        if k.startswith("rng/") and a.get(k) != b.get(k):
            seen = {r["c"].get(k) for r in ref if r.get("kind") in ("restore", "step")}
            if len(seen) == 1:
                out.append(k)
    return out


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]], steps: int) -> Comparison:
    at = _reference(ref)
    ignored = unused_unseeded(ref, got)
    skip = set(EVIDENCE) | set(ignored) | {f"batch/{k}" for k in ignored}
    records = components = 0
    seen: set[int] = set()
    reruns = 0
    restore_differ: dict[int, list[str]] = {}
    for r in got:
        kind = r.get("kind")
        if kind not in ("restore", "step") or r["step"] not in at:
            continue
        expected, c, seg = at[r["step"]], r["c"], r["seg"]
        if kind == "restore":
            keys = set(c)  # the state parts only (no batch, gradients, metrics, progress)
            differ, agree = _diff(expected, c, keys)
            restore_differ[seg] = differ
        else:
            keys = set(c) | set(expected)
            differ, agree = _diff(expected, c, keys)
            reruns += r["step"] in seen
            seen.add(r["step"])
        records += 1
        components += len(keys)
        real = [k for k in differ if k not in skip]
        if real:
            values = {k: (expected.get(k), c.get(k)) for k in real}
            div = Divergence(r["step"], seg, kind, r.get("resumed_from"), real,
                             [k for k in agree if k not in skip], values, restore_differ.get(seg, []))
            return Comparison(records, components, reruns, div, [], ignored)
    missing = [s for s in range(1, steps + 1) if s not in seen]
    return Comparison(records, components, reruns, None, missing, ignored)
