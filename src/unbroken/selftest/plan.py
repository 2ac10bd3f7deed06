"""Where and how the interrupted run is interrupted: a seeded plan of K interruptions.

Kinds: ``sigkill`` (SIGKILL after a step; every second one is delivered *inside a save*
instead, half-way through a tensor file, before the manifest or before the commit),
``save`` (always inside a save), ``sigterm`` (unbroken's preemption path: save, exit 75),
``exception`` (raised from ``ckpt.step``: the step guard's emergency checkpoint, if the
script uses one). Steps are drawn without replacement from ``[1, steps - 1]`` and sorted;
each interruption fires at the first step >= its step that its process reaches.

:func:`targeted` adds, after the uninterrupted run showed where they are, interruptions at the
places random steps rarely hit: an epoch's last step (a SIGTERM there saves that step, so the
resume starts at the epoch boundary, where epoch-end work is skipped or repeated) and the work
between two steps that reads other DataLoaders (``between``: a SIGKILL inside an evaluation).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

KINDS = ("sigkill", "sigterm", "exception", "save")
SAVE_POINTS = ("save.mid_file", "save.before_manifest", "save.before_commit")
_WHERE = {"save.mid_file": "half-way through a tensor file", "save.before_manifest": "before the manifest",
          "save.before_commit": "before the commit"}


@dataclass(frozen=True)
class Interruption:
    """One planned interruption: ``kind`` at ``step`` (``save``: in the process's first save)."""

    kind: str
    step: int
    point: str = ""
    why: str = ""
    """Why it was placed there (targeted interruptions only)."""

    def describe(self) -> str:
        if self.kind == "save":
            return f"SIGKILL inside its first save ({_WHERE.get(self.point, self.point)})"
        if self.kind == "between":
            return f"SIGKILL during the work after step {self.step} (another DataLoader's batches)"
        what = {"sigkill": "SIGKILL", "sigterm": "SIGTERM", "exception": "an exception"}[self.kind]
        return f"{what} after step {self.step}" + (f" ({self.why})" if self.why else "")

    def env(self, nproc: int = 1) -> dict[str, str]:
        """The environment that makes the script's Checkpointer carry it out (:mod:`.protocol`);
        with several processes (torchrun), on rank 0 only."""
        if self.kind == "save":
            return {"UNBROKEN_FAULTS": f"{self.point}{'@0' if nproc > 1 else ''}=1"}
        return {"UNBROKEN_SELFTEST_KILL": f"{self.kind}@{self.step}"}

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "plan": self.describe()}


def parse_kinds(text: str) -> list[str]:
    """``"sigkill,sigterm"`` -> ``["sigkill", "sigterm"]``; ValueError names an unknown kind."""
    kinds = [k.strip().lower() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"unknown interruption kind(s) {bad or [text]}; choose from {', '.join(KINDS)}")
    return kinds


def make_plan(steps: int, kills: int, kinds: list[str], seed: int) -> list[Interruption]:
    """``kills`` interruptions cycling through ``kinds``, at seeded random steps in ``[1, steps-1]``."""
    if steps < 2 or kills < 1:
        return []
    rng = random.Random(seed)
    at = sorted(rng.sample(range(1, steps), k=min(kills, steps - 1)))
    plan, sigkills, saves = [], 0, 0
    for i, step in enumerate(at):
        kind = kinds[i % len(kinds)]
        if kind == "sigkill":
            sigkills += 1
            kind = "save" if sigkills % 2 == 0 else "sigkill"
        point = ""
        if kind == "save":
            point = SAVE_POINTS[saves % len(SAVE_POINTS)]
            saves += 1
        plan.append(Interruption(kind, step, point))
    return plan


def targeted(plan: list[Interruption], kinds: list[str], epoch_ends: list[int], saved: list[int],
             between: list[int]) -> list[Interruption]:
    """``plan`` plus up to two interruptions where the uninterrupted run showed risky places:

    - at ``epoch_ends[0]`` (an epoch's last step) a ``sigterm`` (it saves that very step), unless
      an interruption of the plan already makes a resume start at an epoch's last step (a SIGTERM
      there, or a SIGKILL or an exception at one that is ``saved``); without ``sigterm`` in
      ``kinds``, a ``sigkill`` at the first epoch's last step that is saved;
    - at ``between[0]`` (a step after which other DataLoaders served batches: an evaluation) a
      SIGKILL during that work, when ``kinds`` has ``sigkill`` or ``save``.

    Sorted by step (at the same step the epoch's resume comes first)."""
    if not plan:
        return plan
    extra: list[Interruption] = []
    covered = any(p.step in epoch_ends and (p.kind == "sigterm" or (p.kind in ("sigkill", "exception")
                                                                      and p.step in saved)) for p in plan)
    if epoch_ends and not covered:
        why = "an epoch's last step"
        if "sigterm" in kinds:
            extra.append(Interruption("sigterm", epoch_ends[0], why=why))
        elif "sigkill" in kinds and any(e in saved for e in epoch_ends):
            extra.append(Interruption("sigkill", next(e for e in epoch_ends if e in saved), why=why))
    if between and ("sigkill" in kinds or "save" in kinds):
        extra.append(Interruption("between", between[0], why="inside the work between two steps"))
    return sorted(plan + extra, key=lambda p: (p.step, p.kind == "between"))
