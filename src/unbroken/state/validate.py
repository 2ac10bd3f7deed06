"""Checking a whole state before training spends time on it (at ``restore()``, before the first save).

Two kinds of problem are found without copying a byte of tensor data:

* **Data whose position cannot be saved**: a plain ``torch.utils.data.DataLoader``, a
  ``Sampler`` or a DataLoader iterator. Saving them is impossible without pickle, and
  leaving them out silently would make a resumed run see other batches. The error says
  what to use instead (:class:`unbroken.data.ResumableLoader`, torchdata's
  ``StatefulDataLoader``), or how to accept the divergence knowingly (``allow_unsaved``).
* **Anything else the codec cannot save**: the state is encoded once into a sink that keeps
  nothing, so an unsupported object anywhere in the tree is reported with its path at the
  start of the run instead of at the first save, hours later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from ..errors import UnsupportedStateError
from .codec import Encoder, PathT, qualname, render_path
from .stateful import is_stateful


class _Discard:
    """A tensor sink that keeps nothing: the encoding is only a check."""

    def add(self, tensor: torch.Tensor, path: PathT) -> dict[str, Any]:
        return {}

    def add_sharded(self, tensor: torch.Tensor, path: PathT) -> dict[str, Any]:
        return {}


def _data_problem(key: str, value: Any) -> str | None:
    """Why ``state[key]`` is a data source whose position a checkpoint cannot hold, or None."""
    if is_stateful(value):
        return None  # ResumableLoader, StatefulDataLoader, a user's own Stateful sampler
    where = render_path((key,))
    fix = (f"Use unbroken.data.ResumableLoader(dataset, batch_size, shuffle=..., seed=...) (or torchdata's "
           f"StatefulDataLoader) instead, or pass allow_unsaved=[{key!r}] to the Checkpointer to leave it "
           "out of checkpoints knowingly (a resumed run then diverges from an uninterrupted one).")
    if isinstance(value, DataLoader):
        shuffled = not isinstance(value.sampler, torch.utils.data.SequentialSampler)
        order = " and its shuffle order" if shuffled else ""
        return (f"{where} is a plain torch DataLoader: its position in the epoch{order} cannot be "
                f"saved, so a resumed run would see other batches than an uninterrupted one. {fix}")
    if isinstance(value, Sampler):
        return (f"{where} is a {qualname(value)} sampler without state_dict(): its position and "
                f"order cannot be saved. {fix}")
    if hasattr(value, "__next__") and hasattr(value, "__iter__"):
        return (f"{where} is an iterator ({qualname(value)}): an iterator's position cannot be saved. "
                "Put the loader itself in the state and create the iterator after restore() "
                "(`for batch in loader:` inside the training loop).")
    return None


def validate_state(state: Mapping[str, Any], allow_unsaved: Iterable[str] = ()) -> None:
    """Raise :class:`~unbroken.errors.UnsupportedStateError` if ``state`` cannot be saved and
    restored exactly; the keys in ``allow_unsaved`` are not checked (they are not saved).

    Every problem found among the top-level values is listed in one error, so one run finds
    them all. Calls ``state_dict()`` on the state's objects (references, no copies)."""
    skip = set(allow_unsaved)
    problems: list[str] = []
    for key, value in state.items():
        if key in skip:
            continue
        problem = _data_problem(key, value)
        if problem is None:
            try:
                Encoder(_Discard()).encode(value, (key,))
            except UnsupportedStateError as e:
                problem = str(e)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise UnsupportedStateError("\n".join(problems) if len(problems) == 1 else
                                    f"{len(problems)} objects in the state cannot be checkpointed:\n- "
                                    + "\n- ".join(problems))
