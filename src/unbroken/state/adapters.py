"""Objects whose own ``state_dict()`` is not their training state get an adapter.

A DeepSpeed engine is an ``nn.Module``: its ``state_dict()`` is the module's weights only
(under ZeRO-3, empty placeholders), not the partitioned fp32 master weights and optimizer
moments that a resume needs. Saved as it is, it would resume silently wrong. So the state
the user passes (``{"engine": engine, "data": loader}``) is seen through :func:`adapt`:
such a value is replaced, for unbroken only, by an :class:`Adapter` that saves and restores
the whole training state of the object (:mod:`unbroken.checkpoint.adapting` finds them). The user's
dict is never changed.

An adapter is a ``Stateful`` with three more duties: ``check(saved)`` refuses a checkpoint
that does not fit before anything is loaded, ``prepare_load(saved)`` makes the live object
ready to be loaded into (optimizer state that does not exist yet), and it is loaded with
the modules, after every checked part (it is too large to copy for a rollback).
"""

from __future__ import annotations

from typing import Any


class Adapter:
    """Base of the adapters: the training state of one live object (``self.target``)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Any) -> None:
        raise NotImplementedError

    def check(self, saved: Any) -> None:
        """Raise :class:`~unbroken.errors.StateMismatchError` if ``saved`` cannot be loaded; change nothing."""

    def prepare_load(self, saved: Any) -> None:
        """Called (on every rank) before sharded pieces are loaded into :meth:`state_dict`'s tensors."""
