"""What the records show around a difference: the facts a diagnosis must agree with before it is printed.

For the first diverging step S of a process (its previous record: the restore at R, or step S-1),
in each run:

- ``drew_before``: per global RNG stream, whether something drew from it between the previous
  record and the step's first training batch (``[uninterrupted, interrupted]``): code between
  ``restore()`` and the first step, or the work between two steps (an evaluation);
- ``side``: the batches other DataLoaders served since the previous step (an evaluation), and
  ``epoch_end``: whether the training data ran out since the previous step;
- ``iterator``: when the interrupted run's training iterator was created (``before restore``,
  ``this step``, ``earlier``);
- ``carried``: the loop's plain variables that exist in both runs at the start of step S and
  hold different values, less those that differ between the runs before any interruption (a
  time stamp): a value carried from step to step outside the state (:mod:`.variables`);
- ``rng_not_drawn``: streams that differ at this step though it draws nothing from them.
"""

from __future__ import annotations

from typing import Any


class Records:
    """The uninterrupted run's records by step: ``at[s]`` the state at the end of step s (step 0:
    as restored at the fresh start)."""

    def __init__(self, ref: list[dict[str, Any]]) -> None:
        self.at: dict[int, dict[str, Any]] = {}
        for r in ref:
            if r.get("kind") == "restore" and r["step"] not in self.at:
                self.at[r["step"]] = r
            elif r.get("kind") == "step":
                self.at[r["step"]] = r

    def before(self, step: int) -> dict[str, Any] | None:
        """The record just before ``step``'s in the uninterrupted run."""
        return self.at.get(step - 1)


def _v(rec: dict[str, Any] | None, end: bool = False) -> tuple[dict[str, list[str]], str]:
    e = (rec or {}).get("e") or {}
    key = "v_end" if end else "v"
    return e.get(key) or {}, e.get(f"{key[0]}f{key[1:]}", "")


def noise(recs: Records, got: list[dict[str, Any]]) -> set[str]:
    """Variables that differ between the runs before any interruption (time stamps, process ids):
    never evidence of a value missing from the state."""
    out: set[str] = set()
    for r in got:
        if r.get("seg") != 0 or r.get("kind") not in ("step", "restore"):
            continue
        ref = recs.at.get(r["step"])
        if ref is None or (ref.get("kind") != r.get("kind")):
            continue
        for end in (False, True):
            (a, fa), (b, fb) = _v(ref, end), _v(r, end)
            if fa == fb:
                out.update(n for n in a if n in b and a[n][1] != b[n][1])
    return out


def first_after_resume(rec: dict[str, Any], prev: dict[str, Any] | None) -> bool:
    """Whether ``rec`` is the first step of a process that resumed from a checkpoint."""
    return prev is not None and prev.get("kind") == "restore" and prev.get("resumed_from") is not None


def skipped_work(recs: Records, rec: dict[str, Any], prev: dict[str, Any]) -> list[dict[str, Any]]:
    """The first step after a resume at R: whether the work between steps R and R+1 that used other
    DataLoaders (an evaluation) ran a different number of batches than in the uninterrupted run."""
    ref = recs.at.get(rec["step"])
    if ref is None:
        return []
    a, b = (ref.get("e") or {}).get("side", 0), (rec.get("e") or {}).get("side", 0)
    if a == b:
        return []
    return [{"resumed_from": prev.get("resumed_from"), "step": rec["step"], "uninterrupted": a, "interrupted": b,
             "epoch_end": bool((ref.get("e") or {}).get("epoch_end"))}]


def carried(ref: dict[str, Any], rec: dict[str, Any], ref_prev: dict[str, Any] | None,
            prev: dict[str, Any] | None, quiet: set[str]) -> list[dict[str, Any]]:
    """The loop's variables that hold different values in the two runs at the start of this step (see the
    module docstring). At the first step after a restore without DataLoader batches, the start of the step
    is the end of the previous one in the uninterrupted run and ``restore()`` in the resumed process; there a
    variable also counts when the resumed process makes it only after ``restore()`` (``"created": True``)
    if the loop reads it before it sets it (a batch fetched ahead); and none counts that holds the same value
    in both runs at the end of this step (set from the progress on the line after ``restore()``)."""
    (a, fa), (b, fb) = _v(ref), _v(rec)
    after_restore = not (a and b and fa == fb) and prev is not None and prev.get("kind") == "restore"
    if after_restore:
        (a, fa), (b, fb) = _v(ref_prev, end=True), _v(prev)
    if not (a and fa == fb):
        return []
    reads = set((rec.get("e") or {}).get("reads") or ()) if after_restore else set()
    (end_a, _), (end_b, _) = _v(ref, end=True), _v(rec, end=True)
    names = [n for n in a if n not in quiet and (n in b and a[n][1] != b[n][1] or n not in b and n in reads)
             and not (after_restore and n in end_a and n in end_b and end_a[n][1] == end_b[n][1])]
    names.sort(key=lambda n: (not a[n][0].startswith(("a tensor", "an array", "a tuple", "a list")), n))
    return [{"name": n, "uninterrupted": a[n][0], "interrupted": b[n][0] if n in b else "not yet made",
             "where": fa, "created": n not in b} for n in names]


def gather(recs: Records, rec: dict[str, Any], prev: dict[str, Any] | None, ref: dict[str, Any],
           not_drawn: list[str], quiet: set[str]) -> dict[str, Any]:
    """The evidence around the first diverging step record ``rec`` (``prev``: the previous record of its
    process; ``ref``: the uninterrupted run's record of the same step)."""
    ref_prev = recs.before(rec["step"])
    e_ref, e_got = ref.get("e") or {}, rec.get("e") or {}
    drew_before: dict[str, list[bool | None]] = {}
    for s in sorted({k.rsplit("/", 1)[1] for k in rec["c"] if k.startswith("batch/rng/")}):
        pair: list[bool | None] = []
        for r, p in ((ref, ref_prev), (rec, prev)):
            start, first = (p or {}).get("c", {}).get(f"rng/{s}"), r["c"].get(f"batch/rng/{s}")
            pair.append(None if start is None or first is None else start != first)
        drew_before[s] = pair
    return {"drew_before": drew_before,
            "side": [e_ref.get("side", 0), e_got.get("side", 0)],
            "epoch_end": [bool(e_ref.get("epoch_end")), bool(e_got.get("epoch_end"))],
            "iterator": e_got.get("iterator"),
            "carried": carried(ref, rec, ref_prev, prev, quiet),
            "rng_not_drawn": sorted({k.rsplit("/", 1)[1] for k in not_drawn}),
            "previous": "restore" if prev is not None and prev.get("kind") == "restore" else "step"}
