"""Post-resume probe: prove right after a restore that the run will continue as before.

A probe is a function returning a few numbers computed from the live training state.
It runs when a checkpoint is saved (the values go into the manifest) and again right
after that checkpoint is restored, before training goes on; the two are compared:
``equal`` (bitwise), ``within tolerance`` (e.g. another GPU model) or ``different``.

:func:`probe_step` builds the most telling probe: one full training step on a fixed
batch applied to a *throwaway copy* of model, optimizer and scheduler, returning the
loss before the step, the loss after it and the next learning rates. A wrong restore
shows up in at least one of them: wrong weights in the loss, wrong optimizer moments
in the loss after the step, a forgotten scheduler in the next learning rate. The copy
costs the memory of the model and optimizer once per save; leave the probe off for
models that do not fit twice.

Probes run inside a fork of every RNG (python, numpy, torch CPU and CUDA), so they
never change the random streams of the run. They must not change the state either:
``probe_step`` works on copies and puts the model in eval mode for the losses.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ProbeFn = Callable[[], Mapping[str, float]]


def run_probe(fn: ProbeFn) -> dict[str, float]:
    """Call ``fn`` without disturbing any global RNG; return its values as floats."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            values = fn()
    finally:
        random.setstate(py)
        np.random.set_state(npy)
    return {str(k): float(v) for k, v in dict(values).items()}


def probe_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
               batch: Any, scheduler: Any = None, rtol: float = 1e-5) -> ProbeFn:
    """A probe that trains one step on ``batch`` on a copy: ``loss``, ``loss_after``, ``lr_next*``.

    ``loss_fn(model, batch)`` returns the scalar loss. ``rtol`` is the relative tolerance of
    "within tolerance" after a restore (bitwise equal is "equal"); any probe function may
    carry an ``rtol`` attribute the same way.
    """

    def probe() -> dict[str, float]:
        live = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        twin = copy.deepcopy(live)  # one deepcopy keeps the references between them
        m, opt, sched = twin["model"], twin["optimizer"], twin["scheduler"]
        m.eval()
        with torch.no_grad():
            before = loss_fn(m, batch).item()
        m.train()
        opt.zero_grad(set_to_none=True)
        loss_fn(m, batch).backward()
        opt.step()
        out = {"loss": before}
        if sched is not None:
            with warnings.catch_warnings():  # the copy's step() is not the one the scheduler wrapped
                warnings.filterwarnings("ignore", message=".*optimizer.step\\(\\)", category=UserWarning)
                sched.step()
        for i, group in enumerate(opt.param_groups):
            out[f"lr_next{i}"] = float(group["lr"])
        m.eval()
        with torch.no_grad():
            out["loss_after"] = loss_fn(m, batch).item()
        return out

    probe.rtol = rtol  # type: ignore[attr-defined]
    return probe


@dataclass(frozen=True)
class ProbeReport:
    """The comparison of a probe at save time and after restore."""

    status: str  # "equal", "within tolerance", "different"
    saved: dict[str, float]
    now: dict[str, float]
    rtol: float

    def __str__(self) -> str:
        parts = [f"{k}: {self.saved.get(k)!r} -> {self.now.get(k)!r}" for k in sorted(set(self.saved) | set(self.now))
                 if self.saved.get(k) != self.now.get(k)]
        return f"probe {self.status}" + (f" ({'; '.join(parts)})" if parts else "")


def compare(saved: Mapping[str, float], now: Mapping[str, float], rtol: float = 1e-5) -> ProbeReport:
    """``equal`` if every value is bitwise the same, ``within tolerance`` if within ``rtol``."""
    saved, now = {k: float(v) for k, v in saved.items()}, {k: float(v) for k, v in now.items()}
    if saved.keys() != now.keys():
        return ProbeReport("different", saved, now, rtol)

    def same(a: float, b: float) -> bool:
        return (math.isnan(a) and math.isnan(b)) or a == b

    if all(same(saved[k], now[k]) for k in saved):
        return ProbeReport("equal", saved, now, rtol)
    close = all(same(saved[k], now[k]) or math.isclose(saved[k], now[k], rel_tol=rtol, abs_tol=0.0) for k in saved)
    return ProbeReport("within tolerance" if close else "different", saved, now, rtol)


def check_after_resume(fn: ProbeFn, saved: Mapping[str, float]) -> ProbeReport:
    """Recompute the probe right after a restore, compare it with the saved values (``rtol``
    from the probe function, default 1e-5) and log the verdict: info when equal, a warning
    within tolerance, an error otherwise."""
    import logging

    report = compare(dict(saved), run_probe(fn), float(getattr(fn, "rtol", 1e-5)))
    level = {"equal": logging.INFO, "within tolerance": logging.WARNING}.get(report.status, logging.ERROR)
    logging.getLogger("unbroken").log(level, "post-resume %s", report)
    return report
