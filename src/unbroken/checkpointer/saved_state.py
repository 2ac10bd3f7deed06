"""What a Checkpointer's checkpoint holds, and the checks a state passes before it is saved.

A checkpoint of a :class:`~unbroken.Checkpointer` has two parts (:func:`split`): the *shared*
state, identical on every rank (the user's objects, plus ``__unbroken__``: the loop progress,
the save trigger's state, the names of the per-rank objects), and each rank's own part (its
:class:`~unbroken.PerRank` objects and the global RNG states). :mod:`unbroken.checkpointer.restoring` takes
them apart again.

:class:`StateRules` are the checks on the user's state: the reserved key, the keys left out on
purpose (``allow_unsaved``), the validation before any training step, and the warnings of the
first save (a scheduler-driven optimizer without its scheduler, a save in the middle of gradient
accumulation) and of the first save after training began (a model without the optimizer that steps
it: until then a global optimizer step hook notes which torch optimizers step, so a loop that
updates its parameters by hand, with no optimizer at all, is not warned about).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import UnbrokenError
from ..state.checks import UnbrokenWarning, find_forgotten_state, forgotten_optimizer
from ..state.rng import GlobalRNG
from ..state.stateful import Gradients, PerRank
from ..state.validate import validate_state
from .restoring import RESERVED

log = logging.getLogger("unbroken")


def split(state: Mapping[str, Any], progress: Mapping[str, int], trigger: dict[str, Any] | None,
          rng: bool, rng_states: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(shared, mine)``: what every rank saves together, and this rank's own part (its
    ``PerRank`` objects and, with ``rng``, the global RNGs, or ``rng_states`` if given)."""
    shared: dict[str, Any] = {k: v for k, v in state.items() if not isinstance(v, PerRank)}
    shared[RESERVED] = {"progress": dict(progress)}
    if trigger is not None:
        shared[RESERVED]["trigger"] = trigger
    per_rank = {k: v for k, v in state.items() if isinstance(v, PerRank)}
    if per_rank:
        shared[RESERVED]["per_rank"] = sorted(per_rank)
    mine: dict[str, Any] = {"state": per_rank}
    if rng:
        mine["rng"] = dict(rng_states) if rng_states is not None else GlobalRNG()
    return shared, mine


class StateRules:
    """The checks on a state (see the module docstring); ``allow_unsaved`` keys are neither
    saved, restored nor checked."""

    def __init__(self, allow_unsaved: Iterable[str] = ()) -> None:
        if isinstance(allow_unsaved, str):
            raise TypeError("allow_unsaved takes a list of state keys, e.g. allow_unsaved=['data']")
        self.allow_unsaved: frozenset[str] = frozenset(allow_unsaved)
        self._validated = self._first_save_checked = self._optimizer_checked = False
        self._stepped: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers seen stepping before the first save
        self._watch: Any = None

    def watch_optimizers(self) -> None:
        """Note every torch optimizer that steps, until a save after training began (then the hook goes)."""
        if self._watch is None and not self._optimizer_checked:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            stepped = self._stepped  # not self: the process-wide hook must not keep the rules alive
            self._watch = register_optimizer_step_post_hook(lambda opt, args, kwargs: stepped.add(opt))

    def stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def saved_part(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The part of ``state`` that is saved and restored: all but the ``allow_unsaved`` keys."""
        return {k: v for k, v in state.items() if k not in self.allow_unsaved}

    @staticmethod
    def check_reserved(state: Mapping[str, Any]) -> None:
        if RESERVED in state:
            raise UnbrokenError(f"the state key {RESERVED!r} is reserved for unbroken; rename it")

    def validate(self, state: Mapping[str, Any]) -> None:
        """Check the whole state once, before training spends time on it."""
        if self._validated:
            return
        validate_state(state, self.allow_unsaved)
        self._validated = True
        left_out = sorted(self.allow_unsaved & set(state))
        if left_out:
            log.warning("not saved (allow_unsaved): %s; a resumed run will not continue %s exactly",
                        ", ".join(f"state[{k!r}]" for k in left_out), "them" if len(left_out) > 1 else "it")

    def before_save(self, state: Mapping[str, Any], micro_step: int, step: int = 0) -> None:
        """Warn (once) about state that looks forgotten, and about a save in the middle of
        gradient accumulation without the gradients. ``step``: the optimizer steps done."""
        messages = []
        if not self._first_save_checked:
            self._first_save_checked = True
            messages += find_forgotten_state(state)
        if not self._optimizer_checked and (step or len(self._stepped)):  # training began: the evidence is in
            self._optimizer_checked = True
            messages += forgotten_optimizer(state, list(self._stepped))
            self.stop_watching()
        for message in messages:
            warnings.warn(message, UnbrokenWarning, stacklevel=3)
        if micro_step and not any(isinstance(v, Gradients) for v in state.values()):
            warnings.warn(
                f"saving in the middle of gradient accumulation (micro_step={micro_step}) "
                "without the accumulated gradients; add unbroken.Gradients(model) to the state",
                UnbrokenWarning, stacklevel=3)
