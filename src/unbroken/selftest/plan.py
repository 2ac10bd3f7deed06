"""Where and how the interrupted run is interrupted: a seeded plan of K interruptions.

Kinds: ``sigkill`` (SIGKILL after a step; every second one is delivered *inside a save*
instead, half-way through a tensor file, before the manifest or before the commit),
``save`` (always inside a save), ``sigterm`` (unbroken's preemption path: save, exit 75),
``exception`` (raised from ``ckpt.step``: the step guard's emergency checkpoint, if the
script uses one). Steps are drawn without replacement from ``[1, steps - 1]`` and sorted;
each interruption fires at the first step >= its step that its process reaches.
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

    def describe(self) -> str:
        if self.kind == "save":
            return f"SIGKILL inside its first save ({_WHERE.get(self.point, self.point)})"
        what = {"sigkill": "SIGKILL", "sigterm": "SIGTERM", "exception": "an exception"}[self.kind]
        return f"{what} after step {self.step}"

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
