"""Test harness: run an upstream-shaped script unchanged, interrupt it on request, record what the
comparison with an uninterrupted run needs.

    python harness.py OUT SCRIPT [ARGS...]

It wraps ``Checkpointer.restore``, ``step`` and ``end_epoch`` (recording only: nothing here draws
from a random generator or changes the state) and runs SCRIPT as ``__main__``. Appended to OUT,
one ``os.write`` per line so a SIGKILL never leaves half a line:

- ``attempts.jsonl``: at each restore, the step and progress it resumed from;
- ``steps.jsonl``: at each ``ckpt.step``, the step and its loss (``float.hex``);
- ``epochs.jsonl``: at each ``ckpt.end_epoch`` (the epoch-end work done), the step and a digest of
  the whole state (model, optimizer, scheduler, data position, loop variables);
- ``final.json``: the digest of the state when the script ends normally.

Interruptions (``UPSTREAM_FAULT``), each a real signal this process sends itself:

- ``step:N:SIGNAL``: right after ``ckpt.step`` of step N returned (its save, if any, committed);
- ``eval:N:K:SIGNAL``: at the K-th forward pass of the state's model in eval mode after step N
  (during the evaluation that follows step N).

Negative controls (``UPSTREAM_BREAK``): ``old-loader`` gives a ``ResumableLoader`` restored at the
end of an epoch the behaviour it had before the epoch boundary existed (it serves the next epoch
at once); ``no-hidden`` restores an ``unbroken.Vars`` with its ``hidden`` zeroed (a carried RNN state
left out); ``no-fetched`` restores an ``unbroken.Vars`` with its ``X`` and ``Y`` set to ``None`` (the batch a
loop fetched ahead left out: the script fetches a new one). Kills inside a save use ``UNBROKEN_FAULTS``,
as everywhere in the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import torch

import unbroken
from unbroken.data import ResumableLoader
from unbroken.checkpointer.manager import Checkpointer

OUT = Path(sys.argv[1])
SCRIPT = sys.argv[2]
KIND, *REST = os.environ.get("UPSTREAM_FAULT", "none").split(":")
AT = int(REST[0]) if REST else -1
NTH = int(REST[1]) if KIND == "eval" else 0
SIG = getattr(signal, REST[-1]) if REST else None
seen: dict[str, Any] = {"state": None, "step": -1, "evals": 0}


def write(name: str, record: dict[str, Any]) -> None:
    fd = os.open(OUT / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def _feed(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        for k in sorted(x, key=repr):
            h.update(repr(k).encode())
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(b"[")
        for v in x:
            _feed(h, v)
        h.update(b"]")
    elif hasattr(x, "state_dict"):
        _feed(h, x.state_dict())
    elif isinstance(x, float):
        h.update(float.hex(x).encode())
    else:
        h.update(repr(x).encode())


def digest(state: Any) -> dict[str, str]:
    out = {}
    for key in sorted(state):
        h = hashlib.sha256()
        _feed(h, state[key])
        out[key] = h.hexdigest()[:24]
    return out


def interrupt() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), SIG)


_restore, _step, _end_epoch = Checkpointer.restore, Checkpointer.step, Checkpointer.end_epoch


def restore(self: Checkpointer, state: Any, *args: Any, **kwargs: Any) -> Any:
    info = _restore(self, state, *args, **kwargs)
    seen.update(state=state, step=self.progress.step, evals=0)
    write("attempts.jsonl", {"resumed_from": info.step if info else None, "progress": self.progress.state_dict()})
    return info


def step(self: Checkpointer, state: Any, **metrics: Any) -> Any:
    write("steps.jsonl", {"step": self.progress.step + 1, "loss": float(metrics["loss"]).hex()})
    info = _step(self, state, **metrics)
    seen.update(state=state, step=self.progress.step, evals=0)
    if KIND == "step" and self.progress.step == AT:
        interrupt()
    return info


def end_epoch(self: Checkpointer, state: Any, **metrics: Any) -> Any:
    write("epochs.jsonl", {"step": self.progress.step, "state": digest(state)})
    return _end_epoch(self, state, **metrics)


def forward_pre_hook(module: torch.nn.Module, args: Any) -> None:
    state = seen["state"]
    if KIND == "eval" and state is not None and module is state.get("model") and not module.training \
            and seen["step"] == AT:
        seen["evals"] += 1
        if seen["evals"] == NTH:
            interrupt()


Checkpointer.restore, Checkpointer.step, Checkpointer.end_epoch = restore, step, end_epoch  # type: ignore[method-assign]
torch.nn.modules.module.register_module_forward_pre_hook(forward_pre_hook)
if os.environ.get("UPSTREAM_BREAK") == "old-loader":
    _load = ResumableLoader.load_state_dict

    def old_load(self: ResumableLoader, state: Any) -> None:
        _load(self, state)
        self._served_end = True  # restored at an epoch's end: the next iterator serves the next epoch

    ResumableLoader.load_state_dict = old_load  # type: ignore[method-assign]
elif os.environ.get("UPSTREAM_BREAK") == "no-hidden":
    _vars_load = unbroken.Vars.load_state_dict

    def no_hidden(self: Any, state: Any) -> None:
        hidden = state.get("hidden")
        zeros = tuple(torch.zeros_like(t) for t in hidden) if isinstance(hidden, tuple) else hidden
        _vars_load(self, {**state, "hidden": zeros})  # as if the script began each resumed epoch afresh

    unbroken.Vars.load_state_dict = no_hidden  # type: ignore[method-assign]

elif os.environ.get("UPSTREAM_BREAK") == "no-fetched":
    _vars_restore = unbroken.Vars.load_state_dict

    def no_fetched(self: Any, state: Any) -> None:  # as if the batch fetched ahead were not in the state
        _vars_restore(self, {k: None if k in ("X", "Y") else v for k, v in state.items()})

    unbroken.Vars.load_state_dict = no_fetched  # type: ignore[method-assign]

sys.argv = [SCRIPT, *sys.argv[3:]]
sys.path.insert(0, str(Path(SCRIPT).resolve().parent))
runpy.run_path(SCRIPT, run_name="__main__")
write("final.json", {"state": digest(seen["state"]), "unbroken": unbroken.__version__})
