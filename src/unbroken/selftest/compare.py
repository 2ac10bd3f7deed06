"""Align the interrupted run's per-step records with the uninterrupted run's; find the first difference.

Every record of the interrupted run is compared, in the order they were written:

- each process's ``restore`` record (the state as restored at step R) with the state that was
  saved at step R: the interrupted run's own record of step R (the process that saved it), or
  the uninterrupted run's where it has none (a fresh start: step 0). This checks the round trip;
- each ``step`` record with the same step of the uninterrupted run, steps re-run after a resume
  included.

What counts is what the training consumes and produces: the training batches, gradients,
parameters, optimizer, the other state keys, the metrics, and a global RNG stream only where a
step draws from it. A stream that differs while no step draws from it (an evaluation after a
step drew from it in one run and was skipped by a resume from that step in the other) changes
nothing the training computes: it is listed (:attr:`Comparison.not_drawn`), not a divergence. The first
record that differs in a counted component is the divergence; its components are listed in
causal order (the data first, then the RNG, gradients, parameters, optimizer, the rest), with
the evidence of :mod:`.evidence`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .evidence import Records, first_after_resume, gather, noise, skipped_work
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


def stream(name: str) -> str | None:
    """The global RNG stream a component fingerprints (``rng/torch``, ``batch/rng/torch`` -> ``torch``)."""
    for prefix in ("batch/rng/", "rng/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


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
    evidence: dict[str, Any] = field(default_factory=dict)
    """What the records show around the difference (:func:`.evidence.gather`)."""

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "segment": self.segment, "record": self.kind,
                "resumed_from": self.resumed_from, "components": self.differ, "agreeing": self.agree,
                "values": {k: {"uninterrupted": a, "interrupted": b} for k, (a, b) in self.values.items()},
                "after_restore_differ": self.restore_differ, "evidence": self.evidence}


@dataclass
class Comparison:
    """What :func:`compare` found: counts, the first divergence (or none), and what it set aside."""

    compared_records: int
    compared_components: int
    rerun_steps: int
    divergence: Divergence | None
    missing_steps: list[int]
    ignored: list[str] = field(default_factory=list)
    """Global RNG streams left out: not seeded (they differ from the start) and never drawn from."""
    missing_rank: int | None = None
    """Under torchrun: the rank whose ``missing_steps`` these are."""
    not_drawn: list[dict[str, Any]] = field(default_factory=list)
    """Global RNG streams that differed at a step that did not draw from them (first step per stream)."""
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """Resumes after which the work between two steps (other DataLoaders) ran differently
    (:func:`.evidence.skipped_work`)."""


def _diff(a: dict[str, str], b: dict[str, str], keys: set[str]) -> tuple[list[str], list[str]]:
    differ = sorted((k for k in keys if a.get(k) != b.get(k)), key=order)
    agree = sorted((k for k in keys if a.get(k) == b.get(k)), key=order)
    return differ, agree


def drew(rec: dict[str, Any], prev: dict[str, Any] | None, name: str) -> bool:
    """Whether the step of ``rec`` drew from global RNG stream ``name``: it changed between the step's first
    training batch (else the previous record of the process) and the step's end. Unknown counts as drawn."""
    c = rec["c"]
    start = c.get(f"batch/rng/{name}")
    if start is None and prev is not None:
        start = prev["c"].get(f"rng/{name}")
    end = c.get(f"rng/{name}")
    return start is None or end is None or start != end


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
    """Compare the interrupted run's records ``got`` with the uninterrupted run's ``ref`` up to step ``steps``
    (see the module docstring)."""
    recs = Records(ref)
    ignored = unused_unseeded(ref, got)
    skip = set(EVIDENCE) | set(ignored) | {f"batch/{k}" for k in ignored}
    quiet = noise(recs, got)
    records = components = reruns = 0
    seen: set[int] = set()
    restore_differ: dict[int, list[str]] = {}
    own: dict[int, dict[str, Any]] = {}  # the interrupted run's latest record of each step
    prev: dict[str, Any] | None = None  # the previous record of the same process
    not_drawn: dict[str, dict[str, Any]] = {}
    skipped: list[dict[str, Any]] = []
    for r in got:
        kind, step, seg = r.get("kind"), r.get("step"), r.get("seg", 0)
        if kind not in ("restore", "step") or not isinstance(step, int) or not isinstance(seg, int):
            continue
        if prev is not None and prev.get("seg") != seg:
            prev = None
        c = r["c"]
        if kind == "restore":
            saved = own.get(step) if r.get("resumed_from") is not None else None
            expected = saved or recs.at.get(step)
            if expected is None:
                prev = r
                continue
            keys = set(c)  # the state parts only (no batch, gradients, metrics, progress)
            differ, agree = _diff(expected["c"], c, keys)
            restore_differ[seg] = differ
            uncounted: list[str] = []
        else:
            expected = recs.at.get(step)
            if expected is None:
                continue
            keys = set(c) | set(expected["c"])
            differ, agree = _diff(expected["c"], c, keys)
            reruns += step in seen
            seen.add(step)
            own[step] = r
            drawn = {s for s in {stream(k) for k in differ} if s is not None
                     and (drew(expected, recs.before(step), s) or drew(r, prev, s))}
            uncounted = [k for k in differ if stream(k) is not None and stream(k) not in drawn and k not in skip]
            if prev is not None and first_after_resume(r, prev):
                skipped.extend(skipped_work(recs, r, prev))
        records += 1
        components += len(keys)
        real = [k for k in differ if k not in skip and k not in uncounted]
        if real:
            values = {k: (expected["c"].get(k), c.get(k)) for k in real}
            div = Divergence(step, seg, kind, r.get("resumed_from"), real,
                             [k for k in agree if k not in skip], values, restore_differ.get(seg, []))
            if kind == "step":
                div.evidence = gather(recs, r, prev, expected, uncounted, quiet)
                since = {s: not_drawn[s] for s in {stream(k) for k in real} if s in not_drawn}
                if since:
                    div.evidence["rng_differs_since"] = since
            return Comparison(records, components, reruns, div, [], ignored, None,
                              list(not_drawn.values()), skipped)
        new = sorted({s for k in uncounted if (s := stream(k)) is not None} - set(not_drawn))
        if new:
            ev = gather(recs, r, prev, expected, uncounted, quiet)
            for s in new:
                not_drawn[s] = {"stream": s, "step": step, "segment": seg, "resumed_from": r.get("resumed_from"),
                                "drew_before": ev["drew_before"].get(s), "side": ev["side"],
                                "epoch_end": ev["epoch_end"]}
        prev = r
    missing = [s for s in range(1, steps + 1) if s not in seen]
    return Comparison(records, components, reruns, None, missing, ignored, None, list(not_drawn.values()), skipped)
