"""What can live in the state: the ``Stateful`` protocol and two small helpers.

Any object with ``state_dict()`` and ``load_state_dict(d)`` is ``Stateful``; no base
class is needed. ``nn.Module``, optimizers, LR schedulers and ``GradScaler`` already
are. :class:`Progress` holds the loop counters; :class:`Gradients` captures the
``.grad`` of a model's parameters so a checkpoint taken in the middle of gradient
accumulation resumes exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch


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

    ``step`` counts completed optimizer steps, ``epoch`` the current epoch,
    ``micro_step`` the micro-batches already accumulated into the current step, and
    ``samples`` the global number of samples consumed (what data position is derived
    from). :meth:`unbroken.Checkpointer.step` advances ``step``; the rest is yours.
    """

    step: int = 0
    epoch: int = 0
    micro_step: int = 0
    samples: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        names = {f.name for f in fields(self)}
        for k, v in state_dict.items():
            if k in names:
                setattr(self, k, int(v))


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
