"""Trace what one ``ckpt.step()`` that saves and one ``ckpt.restore()`` walk through in ``unbroken``.

Runs a tiny loop (a model, AdamW, a scheduler, a ``ResumableLoader``) into a fresh run folder, and records
every Python call made inside the package while (1) a ``step()`` saves and (2) a second Checkpointer's
``restore()`` reads that checkpoint back. For each walk it prints the modules visited, the folders
visited (a module at the package's root counts as the folder ``.``), and the folder boundaries crossed:
the distinct (caller's folder, callee's folder) pairs of calls from one folder into another, and how
many such calls there were. ``--json`` writes the same. ``docs/architecture.md`` shows the result for
today's tree and for the tree before the folders (issue 34)::

    python tools/trace_walk.py
    git worktree add /tmp/before 3860d95^          # the tree before issue 34
    PYTHONPATH=/tmp/before/src python tools/trace_walk.py --json /tmp/before.json

Only calls on the training thread are recorded (a background save's thread, if any, is not this walk).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any


class Walk:
    """The calls made inside one package folder tree while it is active."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()

    def module(self, frame: FrameType | None) -> str | None:
        if frame is None:
            return None
        path = Path(frame.f_code.co_filename)
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = self.module(frame)
        if callee is None:
            return
        self.modules[callee] += 1
        caller = frame.f_back
        while caller is not None and self.module(caller) is None:
            caller = caller.f_back  # through torch, the stdlib: the nearest frame of the package
        if caller is not None:
            a, b = folder(self.module(caller) or ""), folder(callee)
            if a != b:
                self.edges[(a, b)] += 1

    def summary(self) -> dict[str, Any]:
        return {"modules": sorted(self.modules), "folders": sorted({folder(m) for m in self.modules}),
                "crossings": {f"{a} -> {b}": n for (a, b), n in sorted(self.edges.items())}}


def folder(module: str) -> str:
    """``checkpoint/persist.py`` -> ``checkpoint``; a module at the package's root -> ``.``."""
    return str(Path(module).parent)


def traced(root: Path, fn: Any) -> dict[str, Any]:
    walk = Walk(root)
    sys.setprofile(walk)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return walk.summary()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the two walks here")
    args = ap.parse_args()

    import torch

    import unbroken
    import unbroken.data

    root = Path(unbroken.__file__).resolve().parent
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))

    def parts() -> tuple[torch.nn.Module, dict[str, Any]]:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        loader = unbroken.data.ResumableLoader(data, batch_size=8, shuffle=True, seed=0)
        return model, {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        model, state = parts()
        ckpt = unbroken.Checkpointer(str(run), save_every=2, keep_last=2)
        ckpt.restore(state)
        walks: dict[str, Any] = {}
        for i, (x, y) in enumerate(state["data"]):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            state["optimizer"].step()
            state["scheduler"].step()
            state["optimizer"].zero_grad()
            if i == 3:  # the second save: what a save costs in a run that has one already
                walks["step() that saves"] = traced(root, lambda loss=loss: ckpt.step(state, loss=loss))
                break
            ckpt.step(state, loss=loss)
        ckpt.close()
        _, state2 = parts()
        ckpt2 = unbroken.Checkpointer(str(run), save_every=2, keep_last=2)
        walks["restore()"] = traced(root, lambda: ckpt2.restore(state2))
        assert ckpt2.progress.step == 4, ckpt2.progress.step
        ckpt2.close()

    for name, w in walks.items():
        crossings = w["crossings"]
        print(f"{name}: {len(w['modules'])} modules in {len(w['folders'])} folders; "
              f"{len(crossings)} folder boundaries crossed ({sum(crossings.values())} calls)")
        print("  folders: " + ", ".join(w["folders"]))
        print("  modules: " + ", ".join(w["modules"]))
    if args.json:
        Path(args.json).write_text(json.dumps(walks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
