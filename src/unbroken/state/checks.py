"""Checks on the state and metrics before a save: forgotten state, JSON-safe metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


class UnbrokenWarning(UserWarning):
    """Something in the state will probably make a resumed run diverge."""


def clean_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as JSON-safe scalars: tensors and numpy scalars become floats, nan a string."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else repr(v)
        elif isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = repr(v)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[str(k)] = v
        else:
            out[str(k)] = repr(v)
    return out


def forgotten_optimizer(state: Mapping[str, Any], stepped: Sequence[Any]) -> list[str]:
    """The warning for a model in the state without the optimizer that steps it: ``stepped`` are
    the optimizers seen stepping. None of them updating the model means the loop updates its
    parameters by hand (``p.data.add_(p.grad, alpha=-lr)``): there is no optimizer to forget."""
    values = list(state.values())
    if any(isinstance(v, torch.optim.Optimizer) for v in values):
        return []
    params = {id(p) for v in values if isinstance(v, torch.nn.Module) for p in v.parameters()}
    culprit = next((o for o in stepped if any(id(p) in params for g in o.param_groups for p in g["params"])), None)
    if culprit is None:
        return []
    return [f"the state holds a model but not the {type(culprit).__name__} optimizer that steps its parameters: a "
            "resumed run would restart the optimizer's moments and diverge; add it, e.g. state['optimizer'] = opt"]


def find_forgotten_state(state: Mapping[str, Any]) -> list[str]:
    """Warnings about state that is commonly forgotten and makes a resume diverge (the optimizer of a
    model: :func:`forgotten_optimizer`, once optimizers were seen stepping)."""
    values = list(state.values())
    has = lambda cls: any(isinstance(v, cls) for v in values)  # noqa: E731
    out = []
    sched_cls = torch.optim.lr_scheduler.LRScheduler
    for k, v in state.items():
        if isinstance(v, torch.optim.Optimizer) and any("initial_lr" in g for g in v.param_groups) \
                and not has(sched_cls) and not has(torch.optim.lr_scheduler.ReduceLROnPlateau):
            out.append(f"state[{k!r}] is driven by an LR scheduler (its param groups carry "
                       "'initial_lr') but no scheduler is in the state: a resumed run would restart "
                       "the schedule; add it, e.g. state['scheduler'] = scheduler")
    return out
