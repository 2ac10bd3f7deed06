"""Whether a resumed run logged the same metrics as the run it resumed: the check behind
:meth:`unbroken.run.index.index.RunIndex.continuity` and ``unbroken metrics RUN NAME --check``.

An exact resume re-runs the steps after its checkpoint and logs bitwise identical values; so,
at every step logged by several segments (processes), the values must be equal (NaN equals the
same NaN, ``0.0`` differs from ``-0.0``). And every row a save point made durable (a
``metrics_durable`` mark counting each segment's rows) must still be in the index.

The verdict (:attr:`Continuity.verdict`) is one of three: ``continuous`` (at least one re-run
step compared, all equal, none missing), ``not continuous`` (a step differs or a row is missing)
and ``not checked`` (nothing compared and nothing missing: no proof either way). ``ok`` only says
that nothing was found wrong, which is also true when nothing was compared.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")  # a float and its bit pattern
CONTINUOUS, NOT_CONTINUOUS, NOT_CHECKED = "continuous", "not continuous", "not checked"


@dataclass
class Continuity:
    """:meth:`RunIndex.continuity` of one metric: ``checked``, the steps logged by several segments;
    ``disagreeing``, those where the segments logged different values (bitwise: NaN equals the same
    NaN, ``0.0`` differs from ``-0.0``); ``values``, for each of those, its ``(segment, value)`` pairs."""

    name: str
    checked: list[int] = field(default_factory=list)
    disagreeing: list[int] = field(default_factory=list)
    values: dict[int, list[tuple[int | None, float]]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    """Steps whose row was made durable at a checkpoint's save point but is not in the index (a
    durable mark counted more rows than there are), as far as the steps can be told."""

    @property
    def ok(self) -> bool:
        """Nothing found wrong (also true when nothing was compared: see :attr:`verdict`)."""
        return not self.disagreeing and not self.missing

    @property
    def verdict(self) -> str:
        """``"continuous"``, ``"not continuous"`` or ``"not checked"`` (no step compared, none missing)."""
        if not self.ok:
            return NOT_CONTINUOUS
        return CONTINUOUS if self.checked else NOT_CHECKED


def compare(name: str, rows: Iterable[tuple[int, int, int | None]], starts: Mapping[int | None, int],
            marks: Iterable[tuple[int | None, list[int] | None]]) -> Continuity:
    """The :class:`Continuity` of metric ``name`` from its ``(step, bits, segment)`` rows in step
    then logging order, each segment's start step, and the durable marks as ``(segment, [count,
    last step] or None)``."""
    per_step: dict[int, dict[int | None, list[int]]] = {}
    for step, bits, seg in rows:
        per_step.setdefault(step, {}).setdefault(seg, []).append(bits)
    report = Continuity(name)
    for step, by_seg in per_step.items():
        if len(by_seg) > 1:
            report.checked.append(step)
            if len({tuple(v) for v in by_seg.values()}) > 1:
                report.disagreeing.append(step)
                report.values[step] = [(g, _F64.unpack(_I64.pack(b))[0]) for g, v in by_seg.items() for b in v]
    report.missing = _missing(per_step, starts, marks)
    return report


def _missing(per_step: dict[int, dict[int | None, list[int]]], starts: Mapping[int | None, int],
             marks: Iterable[tuple[int | None, list[int] | None]]) -> list[int]:
    """Steps of rows a durable mark promised that are not there: for each mark whose segment has
    fewer rows up to the mark's last step than it counted, the steps in that stretch where the
    segment has no row (or the last step, if none can be told)."""
    steps_of: dict[int | None, list[int]] = {}  # per segment, the step of each row, sorted
    for step in sorted(per_step):
        for seg, values in per_step[step].items():
            steps_of.setdefault(seg, []).extend([step] * len(values))
    lost: set[int] = set()
    for segment, promised in marks:
        count, last = promised or (0, 0)
        steps = steps_of.get(segment, [])
        if bisect.bisect_right(steps, last) < count:
            have = set(steps)
            gaps = [s for s in range(starts.get(segment, 0) + 1, last + 1) if s not in have]
            lost.update(gaps or [last])
    return sorted(lost)
