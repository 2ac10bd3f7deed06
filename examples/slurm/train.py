"""Preemption-safe training in a SLURM job: save on the warning signal, requeue, resume.

Submit it with the batch script next to it (from the repository root)::

    sbatch examples/slurm/train.sbatch                 # --steps etc. can follow: sbatch ... --steps 5000

or run it anywhere else as a plain script::

    python examples/slurm/train.py --run-dir runs/slurm-example --steps 300

What happens on a cluster:

1. SLURM sends USR1 to this process ahead of the time limit or a preemption
   (``#SBATCH --signal=B:USR1@120`` in the batch script, which ``exec``\\ s Python so the
   signal reaches it, not a shell). Try it by hand: ``scancel --signal=USR1 --batch JOBID``.
2. The handler only sets a flag; at the next ``ckpt.step()`` unbroken saves (the state
   after that step), runs ``scontrol requeue $SLURM_JOB_ID`` (``Preemption(requeue=True)``)
   and exits with status 75.
3. SLURM starts the job again (``#SBATCH --requeue``); the same command restores the
   newest checkpoint and goes on. The output file (``--open-mode=append``) keeps every
   attempt. The final parameters are bitwise those of a run that was never preempted:
   compare the last lines (``final ... sha256 ...``).

Inside a SLURM job unbroken also writes ``<run-dir>/submit.slurm``: ``sbatch`` it to
continue a run whose job is gone. ``--step-time`` slows each step down, to leave time
to send the signal by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
from torch.utils.data import TensorDataset

import unbroken
import unbroken.data


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for _, st in sorted(opt.state_dict()["state"].items()):
        for _, t in sorted(st.items()):
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/slurm-example")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.0, help="sleep this long in each step (seconds)")
    args = p.parse_args(argv)
    job = os.environ.get("SLURM_JOB_ID")
    print(f"SLURM job {job}, restart {os.environ.get('SLURM_RESTART_COUNT', '0')}" if job else "not in a SLURM job",
          flush=True)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 20, generator=g)
    y = (x[:, :3].sum(dim=1) > 0).long()
    loader = unbroken.data.ResumableLoader(TensorDataset(x, y), batch_size=64, shuffle=True, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ckpt = unbroken.Checkpointer(
        args.run_dir, save_every=args.save_every, keep_last=2,
        # on SIGUSR1/SIGTERM: save at the step boundary, `scontrol requeue` this job, exit 75.
        # grace_period: the seconds of warning asked for with --signal (a slower save is logged).
        preemption=unbroken.Preemption(requeue=True, grace_period=120))
    state = {"model": model, "optimizer": opt, "data": loader}
    info = ckpt.restore(state)
    print(f"resumed from step {info.step}" if info else "fresh start", flush=True)

    while ckpt.progress.step < args.steps:
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(args.step_time)
            ckpt.step(state, loss=loss)  # a preemption signal ends the process here, after saving
            print(f"step {ckpt.progress.step} loss {loss.item()!r}", flush=True)
            if ckpt.progress.step >= args.steps:
                break

    ckpt.close()
    print(f"final step {ckpt.progress.step} sha256 {fingerprint(model, opt)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
