"""A small training job for tests/test_emergency_exact.py: one process of a run, which resumes
from its run folder, trains to ``--steps`` under ``ckpt.guard`` and may raise once at a chosen
point of one step. The final state goes to ``--out`` (safetensors + JSON) for a bitwise
comparison with an uninterrupted run.

Loops (``--loop``):

- ``scaler``: a GradScaler in use; the loss of ``--bad-step`` is inf, so the scaler skips that
  optimizer step while ``scaler.update()`` and ``scheduler.step()`` still run.
- ``skip``: no scaler; the loop skips ``optimizer.step()`` on a non-finite loss (``--bad-step``)
  but steps the scheduler.
- ``plain``: a disabled GradScaler and a per-step LR scheduler.
- ``two``: two optimizers stepped one after the other, no scheduler.
- ``ema``: like ``skip``, plus an EMA copy of the model updated every step, skipped or not.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import unbroken
import unbroken.data


class Boom(RuntimeError):
    pass


def build(loop: str) -> dict:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
    state: dict = {"model": model, "data": unbroken.data.ResumableLoader(data, batch_size=8, shuffle=True, seed=3)}
    if loop == "two":
        state["optimizer"] = torch.optim.AdamW(list(model[0].parameters()) + list(model[1].parameters()), lr=0.05)
        state["head_optimizer"] = torch.optim.SGD(model[4].parameters(), lr=0.1, momentum=0.9)
        return state
    state["optimizer"] = opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    if loop in ("scaler", "plain"):
        state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, enabled=loop == "scaler")
    if loop == "ema":
        state["ema"] = copy.deepcopy(model).requires_grad_(False)
    return state


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--loop", required=True, choices=["scaler", "skip", "plain", "two", "ema"])
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--bad-step", type=int, default=5)
    p.add_argument("--fail-at", type=int, default=0)
    p.add_argument("--fail-point", default="")
    args = p.parse_args()

    state = build(args.loop)
    model, opt, loader = state["model"], state["optimizer"], state["data"]
    sched, scaler = state.get("scheduler"), state.get("scaler")
    ckpt = unbroken.Checkpointer(args.run, save_every=args.save_every, keep_last=None, preemption=None)
    info = ckpt.restore(state)
    print(f"resumed from step {info.step}" if info else "fresh start", flush=True)

    def at(point: str) -> None:
        if point == args.fail_point and ckpt.progress.step + 1 == args.fail_at:
            raise Boom(f"injected failure {point} in step {args.fail_at}")

    with ckpt.guard(state):
        batches = iter(loader)
        while ckpt.progress.step < args.steps:
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            model.train()
            loss = F.cross_entropy(model(x), y)
            if ckpt.progress.step + 1 == args.bad_step and args.loop in ("scaler", "skip", "ema"):
                loss = loss * float("inf")  # a bad batch: the optimizer step is skipped
            at("forward")
            if args.loop == "two":
                loss.backward()
                opt.step()
                at("between the optimizers")
                state["head_optimizer"].step()
                opt.zero_grad()
                state["head_optimizer"].zero_grad()
            elif args.loop in ("skip", "ema"):
                if torch.isfinite(loss):
                    loss.backward()
                    opt.step()
                opt.zero_grad(set_to_none=True)
                at("after optimizer.step")
                if args.loop == "ema":
                    with torch.no_grad():
                        for e, q in zip(state["ema"].parameters(), model.parameters(), strict=True):
                            e.lerp_(q, 0.1)
                sched.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                at("after optimizer.step")
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
            at("after the bookkeeping")
            ckpt.step(state)
    ckpt.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, other = {}, {}
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            tensors.update({f"{key}/{k}": v.contiguous() for k, v in obj.state_dict().items()})
        elif isinstance(obj, torch.optim.Optimizer):
            sd = obj.state_dict()
            tensors.update({f"{key}/{i}/{k}": v for i, s in sd["state"].items() for k, v in s.items()})
            other[key] = sd["param_groups"]
        elif key != "data":
            other[key] = obj.state_dict()
    save_file(tensors, str(out / "final.safetensors"))
    (out / "final.json").write_text(json.dumps(other, sort_keys=True, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
