"""Cheap, exact fingerprints of training state: xxh3-64 of bytes, per component.

A component is one named part of the state at one instant: ``model/parameters``,
``optimizer/moments:exp_avg``, ``scheduler``, ``rng/torch``, ... Its value is a short hex
hash, or the value itself when it is short plain data (a data position, progress
counters), so that a report can show it. Equal fingerprints mean bitwise equal state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ..data.loader import ResumableLoader
from ..state.stateful import PerRank, is_stateful

SHORT = 48
"""Plain values whose JSON is at most this long are kept as they are (readable in reports)."""


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.is_sparse or getattr(t, "is_nested", False):
        return repr(t).encode()
    t = t.to("cpu").contiguous()
    return f"{t.dtype}{tuple(t.shape)}".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _feed(h: Any, x: Any) -> None:
    """Feed any state value into the hash ``h``, tensors by their bytes, containers recursively."""
    if isinstance(x, torch.Tensor):
        h.update(b"T")
        h.update(tensor_bytes(x))
    elif isinstance(x, np.ndarray):
        h.update(b"A" + str(x.dtype).encode() + str(x.shape).encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, Mapping):
        h.update(b"{")
        for k, v in x.items():
            h.update(repr(k).encode())
            _feed(h, v)
        h.update(b"}")
    elif isinstance(x, (list, tuple)):
        h.update(b"[")
        for v in x:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(x, torch.Generator):
        _feed(h, x.get_state())
    elif is_stateful(x):
        _feed(h, x.state_dict())
    elif isinstance(x, float):
        h.update(float.hex(x).encode())
    else:
        h.update(repr(x).encode())


def digest(x: Any) -> str:
    """The fingerprint of one value."""
    h = xxhash.xxh3_64()
    _feed(h, x)
    return h.hexdigest()


def shown(x: Any) -> str:
    """Short plain values as their JSON (readable in reports), anything else as its digest."""
    try:
        text = json.dumps(x, sort_keys=True)
    except (TypeError, ValueError):
        return digest(x)
    return text if len(text) <= SHORT else digest(x)


def rng_streams() -> dict[str, str]:
    """The process-global RNG streams, each hashed on its own."""
    out = {"rng/python": digest(random.getstate()), "rng/numpy": digest(np.random.get_state(legacy=False)),
           "rng/torch": digest(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/cuda:{i}"] = digest(s)
    return out


def _module(key: str, m: torch.nn.Module) -> dict[str, str]:
    out = {f"{key}/parameters": digest([p for _, p in m.named_parameters()])}
    buffers = [b for _, b in m.named_buffers()]
    if buffers:
        out[f"{key}/buffers"] = digest(buffers)
    return out


def _optimizer(key: str, opt: torch.optim.Optimizer) -> dict[str, str]:
    out: dict[str, str] = {}
    names = sorted({k for st in opt.state.values() for k in st})
    params = [p for g in opt.param_groups for p in g["params"]]
    for name in names:
        out[f"{key}/moments:{name}"] = digest([opt.state[p].get(name) if p in opt.state else None for p in params])
    out[f"{key}/hyperparameters"] = digest([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    return out


def state_components(state: Mapping[str, Any]) -> dict[str, str]:
    """Per top-level key, per component: modules (parameters, buffers), optimizers (moments per
    state key, hyperparameters), the data position of a loader, any other value or Stateful whole."""
    out: dict[str, str] = {}
    for key, value in state.items():
        if isinstance(value, PerRank):
            value = value.obj if hasattr(value, "obj") else value
        if isinstance(value, torch.nn.Module):
            out.update(_module(key, value))
        elif isinstance(value, torch.optim.Optimizer):
            out.update(_optimizer(key, value))
        elif isinstance(value, ResumableLoader):
            out[f"{key}/position"] = shown([value.epoch, value.position, value.samples_seen])
        elif isinstance(value, torch.Generator):
            out[key] = digest(value)
        elif is_stateful(value):
            try:
                out[key] = shown(value.state_dict())
            except Exception as e:  # noqa: BLE001 - a fingerprint never stops training
                out[key] = f"error: {type(e).__name__}"
        else:
            out[key] = shown(value) if isinstance(value, (int, float, str, bool, type(None), list, dict)) \
                else digest(value)
    return out


def generator_state(g: Any) -> str | None:
    """The digest of a random generator's state (torch, numpy, python), or ``None`` if ``g`` is none."""
    if isinstance(g, torch.Generator):
        return digest(g.get_state())
    if isinstance(g, np.random.Generator):
        return digest(repr(g.bit_generator.state))
    if isinstance(g, np.random.RandomState):
        return digest(repr(g.get_state(legacy=False)))
    if isinstance(g, random.Random):
        return digest(g.getstate())
    return None
