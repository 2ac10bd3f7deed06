"""What a selftest did not cover, and what it saw that is not a divergence: so a green verdict is not over-read.

From the uninterrupted run's records (:class:`RunShape`): where epochs of the training data end,
after which steps other DataLoaders served batches (an evaluation), how many batches an epoch
has, which lines of the script ran (:mod:`.lines`). :func:`not_covered` says, in words, which
code paths and interruption places the selftest did not exercise: epoch-end work never reached,
no resume at an epoch boundary, no interruption inside the work between steps, interruption
kinds left out, lines of the script that never ran. :func:`explain` turns what the comparison
set aside (an RNG stream that differs but is never drawn from, work between steps skipped after a
resume) into notes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .compare import Comparison
from .diagnose import stream_words
from .plan import KINDS


@dataclass
class RunShape:
    """Where the uninterrupted run's epochs ended and other DataLoaders ran, from its records."""

    epoch_ends: list[int] = field(default_factory=list)
    """Steps that were an epoch's last (the training data ran out right after them)."""
    between: list[int] = field(default_factory=list)
    """Steps after which other DataLoaders served batches before the next step (an evaluation)."""
    epoch_batches: int | None = None
    batches_per_step: int | None = None
    loader: bool = False
    """Whether a DataLoader served the training batches."""
    lines: dict[str, Any] | None = None

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> RunShape:
        """The shape of the uninterrupted run, from its records (its first process, segment 0)."""
        shape = cls()
        for r in records:
            if r.get("kind") == "lines" and shape.lines is None:
                shape.lines = r
            if r.get("kind") != "step" or r.get("seg") != 0:
                continue
            e, s = r.get("e") or {}, r["step"]
            if e.get("epoch_end") and s > 1:
                shape.epoch_ends.append(s - 1)
            if e.get("side") and s > 1:
                shape.between.append(s - 1)
            if "batch/data" in r["c"]:
                shape.loader = True
            if e.get("epoch_len") and shape.epoch_batches is None:
                shape.epoch_batches = e["epoch_len"]
            if e.get("batches") and shape.batches_per_step is None:
                shape.batches_per_step = e["batches"]
        return shape


def not_covered(shape: RunShape, steps: int, kinds: list[str], resumes: list[int], between_killed: bool) -> list[str]:
    """The code paths and interruption places the selftest did not exercise, one sentence each."""
    out: list[str] = []
    if not shape.loader and not shape.epoch_ends:
        out.append("the training batches came from no torch DataLoader the selftest could see and the run's "
                   "progress.epoch never moved: it cannot tell where epochs end, so epoch-end work and a resume "
                   "at an epoch boundary were not checked")
    elif not shape.epoch_ends:
        per = ""
        if shape.epoch_batches and shape.batches_per_step:
            n = -(-shape.epoch_batches // shape.batches_per_step)
            per = (f" (an epoch is about {n} steps: use --steps above {n})" if n >= steps else
                   f" (its DataLoader has {shape.epoch_batches} batches, {shape.batches_per_step} per step, yet "
                   "none ran out: the loop leaves its epochs early, or re-creates the loader)")
        out.append(f"no epoch of the training data ended within the {steps} steps{per}: what runs after an epoch "
                   "(evaluation, per-epoch schedulers, saves at the epoch's end) never ran, and no resume started "
                   "at an epoch boundary")
    elif not set(resumes) & set(shape.epoch_ends):
        out.append(f"no process resumed from a checkpoint of an epoch's last step (steps "
                   f"{', '.join(map(str, shape.epoch_ends[:5]))}): epoch-end work skipped or repeated after such a "
                   "resume was not checked (a SIGTERM there saves that step: keep sigterm in --kinds)")
    if shape.between and not between_killed:
        out.append(f"no interruption came during the work between two steps (other DataLoaders served batches "
                   f"after steps {', '.join(map(str, shape.between[:5]))}: an evaluation?)")
    missing = [k for k in KINDS if k not in kinds and not (k == "save" and "sigkill" in kinds)]
    if missing:
        out.append(f"interruptions of kind {', '.join(missing)} were not tried (--kinds {','.join(kinds)})")
    out.extend(_lines(shape.lines, steps))
    return out


def _lines(rec: dict[str, Any] | None, steps: int) -> list[str]:
    if rec is None:
        return []
    if rec.get("skipped"):
        return [f"which lines of the script ran was not recorded: {rec['skipped']}"]
    out = []
    for f in rec.get("files", []):
        name = os.path.basename(f["file"])
        parts = [(f"{a}" if a == b else f"{a}-{b}") + f" {where} `{src}`" for a, b, where, src in f["missed"]]
        if parts:
            more = f" and {f['more']} more" if f.get("more") else ""
            out.append(f"lines of {name} that never ran in the uninterrupted run's {steps} steps: "
                       + "; ".join(parts) + more)
        if f.get("after_loop"):
            a, b = f["after_loop"]
            out.append(f"lines {a}-{b} of {name}, after the training loop, never run under the selftest "
                       f"(it stops the script after step {steps})")
    return out


def explain(result: Comparison) -> list[str]:
    """Notes on what the comparison set aside: work between steps skipped or repeated after a resume,
    global RNG streams that differ where no step draws from them."""
    out = []
    for s in result.skipped:
        a, b, r = s["uninterrupted"], s["interrupted"], s["resumed_from"]
        what = (f"after the resume at step {r}, the work between steps {r} and {r + 1} that reads other DataLoaders "
                f"(an evaluation?) served {b} batch{'es' if b != 1 else ''}; the uninterrupted run's served {a}")
        if b < a:
            at = " (at an epoch's last step)" if s.get("epoch_end") else ""
            what += (f": the checkpoint of step {r} was taken{at} before that work, and the resumed loop went on "
                     f"past it; what that work reports (metrics, logs) for step {r} is missing after such a resume")
        out.append(what)
    for s in result.not_drawn:
        where = f" (after the resume at step {s['resumed_from']})" if s.get("resumed_from") is not None else ""
        out.append(f"{stream_words(s['stream'])} differs from step {s['step']} on{where}, but no step drew from "
                   "it, so the training is identical; code that draws from it later would see other numbers")
    return out
