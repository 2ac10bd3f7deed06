"""What can live in the state: the ``Stateful`` protocol and small helpers.

Any object with ``state_dict()`` and ``load_state_dict(d)`` is ``Stateful``; no base
class is needed. ``nn.Module``, optimizers, LR schedulers and ``GradScaler`` already
are. :class:`Progress` holds the loop counters; :class:`Vars` keeps the plain variables a
loop changes (``lr``, ``best_val_loss``, a hidden state carried across batches) and is
restored in place; :class:`Gradients` captures the ``.grad`` of a model's parameters so a
checkpoint taken in the middle of gradient accumulation resumes exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import CorruptCheckpointError


@runtime_checkable
class Stateful(Protocol):
    """An object that can save and restore itself through plain values and tensors.

    ``state_dict()`` must return a tree of supported types (dicts, lists, numbers,
    strings, tensors, numpy arrays, ...). ``load_state_dict(d)`` receives the same
    tree back, with tensors on the CPU unless the live object's tensors were updated
    in place.
    """

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def is_stateful(obj: Any) -> bool:
    """True for instances (not classes) that implement :class:`Stateful`."""
    return not isinstance(obj, type) and isinstance(obj, Stateful)


@dataclass
class Progress:
    """Loop counters saved with every checkpoint.

    - ``step``: completed optimizer steps (:meth:`~unbroken.Checkpointer.step` adds one).
    - ``epoch``: the epochs whose batches are all done, i.e. the index (from 0) of the epoch the
      data is in. It moves on when the epoch's batch loop ends: with a
      :class:`~unbroken.data.ResumableLoader` in the state it is the loader's epoch (which moves
      on when the loop asks for a batch after the last one); with :meth:`~unbroken.Checkpointer.batches`,
      when its source runs out; and :meth:`~unbroken.Checkpointer.end_epoch` (which
      :meth:`~unbroken.Checkpointer.epochs` calls after each epoch's body) moves it on if the loop
      ended the epoch early. Never at the epoch's last step: a checkpoint taken there resumes
      into the epoch, with no batch left, so its epoch-end work runs.
    - ``batch``: the batches of the current epoch that :meth:`~unbroken.Checkpointer.batches` handed
      out (a resumed run skips them); 0 for loops over a ``ResumableLoader``, which keeps its own position.
    - ``micro_step``: the micro-batches already accumulated into the current step.
    - ``samples``: the global number of samples consumed (the ``ResumableLoader``'s count).
    """

    step: int = 0
    epoch: int = 0
    micro_step: int = 0
    samples: int = 0
    batch: int = 0

    def state_dict(self) -> dict[str, int]:
        """The counters; ``batch`` only when it is not 0 (so checkpoints of loops that do not use
        ``ckpt.batches()`` hold the same four counters as before it existed)."""
        out = asdict(self)
        if not out["batch"]:
            del out["batch"]
        return out

    @classmethod
    def check(cls, state_dict: Any) -> None:
        """Raise :class:`~unbroken.errors.CorruptCheckpointError` naming the field unless
        ``state_dict`` is a dict whose counters are integers in ``[0, 2**63)``; changes nothing.
        Unknown keys are ignored and missing counters keep their value (as on load). ``state_dict``
        may be the decoded ``StatefulValue``."""
        cls._counters(state_dict)

    @classmethod
    def _counters(cls, state_dict: Any) -> dict[str, int]:
        from .codec import StatefulValue  # codec imports this module

        if isinstance(state_dict, StatefulValue):
            state_dict = state_dict.value
        if not isinstance(state_dict, dict):
            raise CorruptCheckpointError(f"progress: expected a dict of counters, got {type(state_dict).__name__}")
        out = {}
        for f in fields(cls):
            if f.name not in state_dict:
                continue
            v = state_dict[f.name]
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2**63:
                if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
                    text = f"an integer of {v.bit_length()} bits"
                else:
                    text = repr(v)[:80] if isinstance(v, (int, float, str, type(None))) else type(v).__name__
                raise CorruptCheckpointError(f"progress[{f.name!r}]: expected an integer in [0, 2**63), got {text}")
            out[f.name] = int(v)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the counters from ``state_dict``, all checked first (see :meth:`check`); a missing
        ``batch`` is 0 (see :meth:`state_dict`)."""
        counters = self._counters(state_dict)
        for k, v in {"batch": 0, **counters}.items():
            setattr(self, k, v)


class Vars:
    """The plain variables a loop changes, kept in the state and restored *in place*.

    ``restore()`` replaces a top-level plain value of the state (``state["lr"]``) in the dict, not
    in the variable the script reads, and updates a nested dict in place; a ``Vars`` is an object
    whose attributes are set in place, so the script reads the restored values with no line of
    its own::

        loop = unbroken.Vars(lr=args.lr, best_val_loss=None)
        state = {"model": model, "loop": loop}
        ckpt.restore(state)              # loop.lr and loop.best_val_loss are the saved ones now
        ...
        loop.lr /= 4.0

    Values are anything a checkpoint holds (numbers, ``None``, strings, tensors, tuples of
    tensors such as an RNN's hidden state, lists, dicts). A name the checkpoint does not have
    (a variable added to the script since) keeps its value.
    """

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or not all(isinstance(k, str) for k in state_dict):
            raise TypeError(f"Vars takes a dict of names, got {type(state_dict).__name__}")
        self.__dict__.update(state_dict)

    def __repr__(self) -> str:
        return "Vars(" + ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items()) + ")"


class Gradients:
    """``Stateful`` view of the accumulated gradients of ``module``'s parameters.

    Put it in the state (``state["grads"] = unbroken.Gradients(model)``) when a
    checkpoint may be taken between the micro-batches of one optimizer step; after
    ``optimizer.zero_grad(set_to_none=True)`` it saves ``None`` for each parameter.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {name: p.grad for name, p in self.module.named_parameters()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor | None]) -> None:
        params = dict(self.module.named_parameters())
        unknown = set(state_dict) - set(params)
        if unknown:
            raise KeyError(f"gradients for unknown parameters: {sorted(unknown)[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                g = state_dict.get(name)
                if g is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == g.shape:
                    p.grad.copy_(g)
                else:
                    p.grad = g.to(device=p.device, dtype=p.dtype).clone()


class PerRank:
    """Marks state that differs from rank to rank (``state["loader"] = unbroken.PerRank(loader)``).

    Everything else in the state is taken to be replicated (the same on every rank: a DDP
    model, its optimizer, a :class:`~unbroken.data.ResumableLoader`, whose position is
    global) and written once; a ``PerRank`` object is saved by every rank into its own
    part of the checkpoint and restored on the same rank. If the world size changes, ranks
    the checkpoint had get their own state back and new ranks keep theirs, with a warning.
    Each rank's global RNGs are always per rank.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return self.obj.state_dict() if is_stateful(self.obj) else self.obj

    def load_state_dict(self, state_dict: Any) -> None:
        if is_stateful(self.obj):
            self.obj.load_state_dict(state_dict)
        else:
            raise TypeError("PerRank wraps an object without load_state_dict; wrap a Stateful object")
