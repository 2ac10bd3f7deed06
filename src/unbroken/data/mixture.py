"""``Mixture``: several map-style sources drawn by weight, with weights that may change by
sample (a curriculum), as a map-style dataset whose sample ``g`` is a pure function of
``(seed, g, schedule)``.

Sample ``g`` lies in block ``g // block``. The schedule (:mod:`.schedule`) says how many
draws each source has in that block and how many it had before it; a keyed permutation of
the block (:class:`~unbroken.data.GlobalOrder`) says which slot of the block is which source's
``r``-th draw there. A source's ``k``-th draw is position ``k mod len`` of its own shuffled
order of pass ``k // len``. So any sample is found in O(number of phases), on any worker, any
rank, after any resume, and every source is drawn without repetition within a pass.

Change on purpose at resume (weights, sources added or removed), with :meth:`Mixture.loader`,
which saves the schedule with the data position ``R``: samples before ``R`` stay what they
were; the live weights apply from ``R'``, the first block boundary at or after ``R`` (at most
``block - 1`` samples later; the rest of the current block keeps the checkpoint's weights),
each source's draws continuing where they stood, an added source from its first sample. The
change is logged. A source's length cannot change (give a changed source a new name: it is
then an added source).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .checked import count
from .loader import ResumableLoader
from .order import GlobalOrder, mix_ints
from .sample import SampleIndex
from .schedule import Phase, extend, name_key, same_from, spec_of, weights_at

log = logging.getLogger("unbroken")
ENDLESS = 1 << 62
Weights = Mapping[str, float] | Sequence[tuple[int, Mapping[str, float]]]


class Mixture(Dataset):
    """Map-style ``sources`` drawn by ``weights``, exactly resumable (see the module docstring).

    Args:
        sources: ``{name: dataset}``; each a map-style dataset (``__len__``, ``__getitem__``),
            e.g. a ``datasets.Dataset``. A source receives a :class:`~unbroken.data.SampleIndex`
            (``i.generator()`` keys its augmentation by the source's seed, pass and index).
        weights: ``{name: weight}`` (need not sum to 1), or a schedule
            ``[(0, {...}), (start_sample, {...}), ...]`` whose phases apply from their global
            sample number on (rounded up to a block boundary). A curriculum by step: use
            ``step * global_batch_size`` as the start.
        seed: keys the draws, each source's order and the block permutations.
        block: samples per block: within each block every source has its exact share; a
            weight change at resume applies from the next block boundary.
        shuffle: shuffle each source (a new order each pass), or read it in order.
        length: the dataset length a loader sees (its epoch); default endless (``2**62``).
    """

    def __init__(self, sources: Mapping[str, Any], weights: Weights, *, seed: int = 0, block: int = 1024,
                 shuffle: bool = True, length: int | None = None) -> None:
        if not sources:
            raise ValueError("a Mixture needs at least one source")
        if block < 1:
            raise ValueError("block must be at least 1")
        for name, ds in sources.items():
            if not isinstance(name, str) or not hasattr(ds, "__len__") or len(ds) < 1:
                raise ValueError(f"source {name!r}: sources are {{name (a str): map-style dataset with at least one "
                                 "sample}} (for streaming sources use datasets.interleave_datasets + StreamLoader)")
        self.sources = dict(sources)
        self.seed, self.block, self.shuffle = int(seed), int(block), shuffle
        self.length = ENDLESS if length is None else int(length)
        self._spec = spec_of(weights, list(self.sources), self.block)
        self.phases = extend([], self._spec, self.seed)
        self.passes = {name: {"len": len(ds), "base": 0} for name, ds in self.sources.items()}
        self._perm = GlobalOrder(self.block, mix_ints(self.seed, 0xB10C), shuffle=True)
        self._orders: dict[str, GlobalOrder] = {}
        self._block: tuple[int, list[tuple[str, int, int]]] | None = None
        self._rows: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return self.length

    def _composition(self, j: int, phases: list[Phase]) -> list[tuple[str, int, int]]:
        """Block ``j``: ``(source, first slot, draws before the block)`` runs in name order."""
        if phases is self.phases and self._block is not None and self._block[0] == j:
            return self._block[1]
        start = j * self.block
        phase = phases[bisect.bisect_right([p.start for p in phases], start) - 1]
        before, after = phase.draws(start - phase.start), phase.draws(start - phase.start + self.block)
        runs, slot = [], 0
        for name in sorted(after):
            if after[name] > before.get(name, 0):
                runs.append((name, slot, before.get(name, 0)))
                slot += after[name] - before.get(name, 0)
        if phases is self.phases:
            self._block = (j, runs)
        return runs

    def _slots(self, j: int, t0: int, t1: int, phases: list[Phase]) -> tuple[list[tuple[str, int, int]], np.ndarray]:
        """The runs of block ``j`` and, for its positions ``t0..t1``, the run each one falls in."""
        runs = self._composition(j, phases)
        slots = self._perm.indices(j, t0, t1)
        return runs, np.searchsorted(np.array([r[1] for r in runs]), slots, side="right") - 1

    def _table(self, j: int) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Every position of block ``j``: its source (a number into the names), index and pass."""
        if self._rows is not None and self._rows[0] == j:
            return self._rows[1]
        runs = self._composition(j, self.phases)
        source = np.empty(self.block, dtype=np.int64)
        index, passes = np.empty(self.block, dtype=np.int64), np.empty(self.block, dtype=np.int64)
        ends = [r[1] for r in runs[1:]] + [self.block]
        for r, ((name, first, before), end) in enumerate(zip(runs, ends, strict=True)):
            n, base = self.passes[name]["len"], self.passes[name]["base"]
            rest = np.arange(before - base, before - base + end - first, dtype=np.int64)
            epoch, pos = rest // n, rest % n
            source[first:end], passes[first:end] = r, epoch
            if not self.shuffle:
                index[first:end] = pos
                continue
            order = self._orders.get(name)
            if order is None:
                order = self._orders[name] = GlobalOrder(n, mix_ints(self.seed, name_key(name)))
            for e in np.unique(epoch):  # a block's draws of a source span one pass or a few
                sel = epoch == e
                lo, hi = int(pos[sel][0]), int(pos[sel][-1]) + 1
                index[first:end][sel] = order.indices(int(e), lo, hi)
        at = self._perm.indices(j, 0, self.block)  # position -> slot
        table = ([r[0] for r in runs], source[at], index[at], passes[at])
        self._rows = (j, table)
        return table

    def locate(self, sample: int) -> tuple[str, int, int]:
        """``(source, index in it, its pass)`` of global sample number ``sample``."""
        j, t = divmod(sample, self.block)
        names, source, index, passes = self._table(j)
        return names[source[t]], int(index[t]), int(passes[t])

    def __getitem__(self, index: int) -> Any:
        epoch = index.epoch if isinstance(index, SampleIndex) else 0
        name, i, pass_ = self.locate(epoch * self.length + int(index))
        return self.sources[name][SampleIndex(i, mix_ints(self.seed, name_key(name)) >> 1, pass_)]

    def weights_at(self, sample: int) -> dict[str, float]:
        """The normalized weights in force at global sample number ``sample``."""
        return weights_at([(p.start, p.weights) for p in self.phases], sample)

    def loader(self, batch_size: int, **kwargs: Any) -> ResumableLoader:
        """A :class:`~unbroken.data.ResumableLoader` over this mixture (in sample order: the
        mixture shuffles) that also saves the schedule, so weights and sources may change at a
        resume (the module docstring's rule). ``kwargs`` go to ``ResumableLoader``."""
        if "shuffle" in kwargs:
            raise TypeError("a Mixture's loader reads it in sample order (the mixture shuffles its sources itself)")
        return _MixtureLoader(self, batch_size, seed=kwargs.pop("seed", self.seed), shuffle=False, **kwargs)

    # ------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "block": self.block, "shuffle": self.shuffle, "length": self.length,
                "phases": [p.to_state() for p in self.phases], "passes": {k: dict(v) for k, v in self.passes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule; refuses a change (only :meth:`loader` knows where to apply one)."""
        self._adopt(*self._plan(state, None))

    def _adopt(self, phases: list[Phase], passes: dict[str, dict[str, int]]) -> None:
        self.phases, self.passes, self._block, self._rows = phases, passes, None, None

    def _plan(self, state: Mapping[str, Any], at: int | None) -> tuple[list[Phase], dict[str, dict[str, int]]]:
        """The schedule and passes to continue with from global sample ``at`` (None: no change allowed)."""
        for key in ("seed", "block", "shuffle", "length"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the checkpoint's mixture has {key}={state[key]!r}, this one {getattr(self, key)!r}: "
                                 f"the {key} defines every sample drawn so far, keep it across a resume")
        saved = [Phase(int(p["start"]), {k: float(v) for k, v in p["weights"].items()},
                       {k: int(v) for k, v in p["base"].items()}, self.seed) for p in state["phases"]]
        old_spec = [(p.start, p.weights) for p in saved]
        passes: dict[str, dict[str, int]] = {}
        for name, ds in self.sources.items():
            old = state["passes"].get(name)
            if old is not None and int(old["len"]) != len(ds):
                raise ValueError(f"source {name!r} had {old['len']} samples in the checkpoint and has {len(ds)} now: "
                                 "its draws so far index the old order. Give the changed source a new name (it starts "
                                 f"from its first sample) and weight 0 to {name!r}, or keep its length")
            passes[name] = {"len": len(ds), "base": int(old["base"]) if old else 0}
        added = sorted(set(self.sources) - set(state["passes"]))
        removed = sorted(set(state["passes"]) - set(self.sources))
        cut = 0 if at is None else -(-at // self.block) * self.block
        if same_from(old_spec, self._spec, cut) and not removed:
            return saved, passes
        if at is None:
            raise ValueError(
                "the mixture's weights or sources differ from the checkpoint's, and load_state_dict does not know "
                "the data position to apply the change from. Use mixture.loader(batch_size, ...) in the state (it "
                "saves the position with the schedule), or keep the checkpoint's weights and sources")
        if removed and at < cut:  # the rest of the current block keeps the checkpoint's schedule
            runs, which = self._slots(at // self.block, at % self.block, self.block, saved)
            needed = sorted({runs[i][0] for i in which} & set(removed))
            if needed:
                raise ValueError(f"sources {needed} are not in the mixture, but the checkpoint's schedule still draws "
                                 f"them before sample {cut} (the rest of the current block of {self.block} samples): "
                                 "keep them in the sources, with weight 0, for this resume")
        phases = [p for p in saved if p.start < cut]
        phases = extend(phases, [(cut, weights_at(self._spec, cut))] + [(s, w) for s, w in self._spec if s > cut],
                        self.seed)
        log.warning("mixture weights changed at resume: from sample %d on %s (the checkpoint's: %s)%s%s; the samples "
                    "before it are unchanged", cut, _fmt(weights_at(self._spec, cut)),
                    _fmt(weights_at(old_spec, cut)), f"; sources added: {added}" if added else "",
                    f"; sources removed: {removed}" if removed else "")
        return phases, passes


def _fmt(weights: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:.4g}" for k, v in weights.items()) + "}"


class _MixtureLoader(ResumableLoader):
    """``ResumableLoader`` whose state also holds its mixture's schedule (see :meth:`Mixture.loader`)."""

    dataset: Mixture

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mixture": self.dataset.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        mixture = state.pop("mixture")
        at = count(state, "epoch", "loader") * len(self.dataset) + count(state, "position", "loader",
                                                                         hi=len(self.dataset))
        plan = self.dataset._plan(mixture, at)  # refusals before anything changes
        super().load_state_dict(state)
        self.dataset._adopt(*plan)
