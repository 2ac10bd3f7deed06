"""The weights of a :class:`~unbroken.data.Mixture` over the global sample number, and the
draws of each source they imply, in O(number of phases).

A schedule is a list of *phases*: from sample ``start`` on, the sources are drawn with the
phase's weights. Samples come in blocks of ``block``; phases start at block boundaries. Inside
a phase the number of draws of each source among its first ``m`` samples is a *quota*: a
stick-breaking split of ``m`` in which source ``s`` takes ``floor(rest * w_s / W + phi_s)`` of
what the sources before it left (``W`` the weight not yet split, ``phi_s`` a per-phase offset
in [0, 1) from the seed), the last source the rest. A quota is exact integer arithmetic,
non-decreasing in ``m`` and within one draw of ``m * w_s / sum(w)`` at every ``m``, so a block's
composition (the quota's increase over the block) is never negative and the mixture is exact
in proportion at every block. Where the draws of a source stand at any sample is then the
sum over the phases before it: nothing has to be replayed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .order import mix_ints

_ONE = 1 << 40  # weights as integers of this scale (the proportions are exact to 2**-40)
_PHI = 1 << 32


def name_key(name: str) -> int:
    """A stable 64-bit integer for a source's name (seeds its order and its offsets)."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def normalized(weights: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """The positive weights, summing to 1, keyed by name in sorted order; checks them."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"weights for sources that are not in the mixture: {unknown} (sources: {sorted(names)})")
    for k, w in weights.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
            raise ValueError(f"the weight of source {k!r} is {w!r}: weights are finite numbers >= 0")
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError(f"the weights {dict(weights)} sum to 0: at least one source needs a positive weight")
    return {k: float(weights[k]) / total for k in sorted(weights) if weights[k] > 0}


@dataclass
class Phase:
    """From sample ``start`` on: ``weights`` (normalized); ``base``: each source's draws before ``start``."""

    start: int
    weights: dict[str, float]
    base: dict[str, int] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        self._names = sorted(self.weights)
        self._ints = [max(1, round(self.weights[n] * _ONE)) for n in self._names]
        self._phis = [mix_ints(self.seed, self.start, name_key(n)) % _PHI for n in self._names]

    def quota(self, m: int) -> dict[str, int]:
        """Draws of each source among the phase's first ``m`` samples."""
        out: dict[str, int] = {}
        rest, left = m, sum(self._ints)
        for name, w, phi in zip(self._names[:-1], self._ints[:-1], self._phis[:-1], strict=True):
            q = (rest * w * _PHI + phi * left) // (left * _PHI)
            out[name] = q
            rest -= q
            left -= w
        out[self._names[-1]] = rest
        return out

    def draws(self, m: int) -> dict[str, int]:
        """Draws of each source before the phase's sample ``m`` (the phase's ``base`` included)."""
        q = self.quota(m)
        return {n: self.base.get(n, 0) + q.get(n, 0) for n in set(self.base) | set(q)}

    def to_state(self) -> dict[str, Any]:
        return {"start": self.start, "weights": dict(self.weights), "base": dict(self.base)}


def extend(phases: Sequence[Phase], spec: Sequence[tuple[int, dict[str, float]]], seed: int) -> list[Phase]:
    """``phases`` followed by new ones from ``(start, normalized weights)`` pairs (increasing block
    boundaries after the last phase's start), each with the draws of every source before it."""
    out = list(phases)
    for start, weights in spec:
        counts = out[-1].draws(start - out[-1].start) if out else {}
        out.append(Phase(start, weights, counts, seed))
    return out


def spec_of(weights: Mapping[str, float] | Sequence[tuple[int, Mapping[str, float]]], names: Sequence[str],
            block: int) -> list[tuple[int, dict[str, float]]]:
    """The user's ``weights`` (a mapping, or ``(start_sample, mapping)`` pairs from 0) as
    ``(start, normalized)`` pairs, each start rounded up to a block boundary."""
    pairs = [(0, weights)] if isinstance(weights, Mapping) else list(weights)
    if not pairs or pairs[0][0] != 0:
        raise ValueError("a weight schedule is a list of (start_sample, {source: weight}) pairs; the first starts at 0")
    out: list[tuple[int, dict[str, float]]] = []
    for start, w in pairs:
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"a phase starts at a sample number >= 0, not {start!r}")
        start = -(-start // block) * block
        if out and start <= out[-1][0]:
            if start < out[-1][0]:
                raise ValueError("the phases of a weight schedule must start in increasing order")
            out.pop()  # two phases in one block: the later one applies from the block
        out.append((start, normalized(w, names)))
    return out


def weights_at(spec: Sequence[tuple[int, dict[str, float]]], sample: int) -> dict[str, float]:
    """The weights in force at ``sample``."""
    current = spec[0][1]
    for start, w in spec:
        if start > sample:
            break
        current = w
    return current


def same_from(a: Sequence[tuple[int, dict[str, float]]], b: Sequence[tuple[int, dict[str, float]]],
              sample: int) -> bool:
    """Whether two schedules give the same weights at every sample from ``sample`` on."""
    points = {sample} | {s for s, _ in a if s > sample} | {s for s, _ in b if s > sample}
    return all(weights_at(a, p) == weights_at(b, p) for p in points)
