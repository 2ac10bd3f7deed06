"""tests/dist_train.py (DDP) for the multi-node tests, with what a job whose world size changes needs.

    torchrun --nnodes 1:2 ... tests/multinode_train.py --global-batch 16 --stop-after 11@1 <dist_train args>

- ``--global-batch G``: every rank takes ``G / WORLD_SIZE`` samples per step, so the global batch,
  and with it every step's samples, stays the same when the elastic agent restarts the job at
  another world size (dist_train's ``--batch`` is per rank and fixed by the command line).
- ``--stop-after N[@W]``: the rank stops itself (SIGSTOP) right after step N (only at world size W,
  if given), printing ``stopped after step N (pid P)``: the test then knows where the job is (no
  save can be under way, the other ranks wait in the next step's collectives) when it kills the
  node, or, at world size 1, holds the job there until a new node has joined. Once per rank and
  run: a worker torchrun restarts does not stop there again (``OUT/stopped-r<rank>-s<N>``).
- Under torchrun the process group is started at every world size, 1 included, so the model is
  always wrapped in DDP (dist_train.py leaves a single process unwrapped).
- ``OUT/exit-r<rank>``: the exit status each rank leaves with (torchrun reaps its workers without
  reporting it), as tests/signals_train.py records it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import dist_train

import unbroken


def _take(argv: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` from ``argv``; VALUE, or None if absent."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def _stop_after(spec: str, world: int, out: Path) -> None:
    """``--stop-after N[@W]``: SIGSTOP this process right after ``ckpt.step`` of step N (at world size W),
    once per rank and run."""
    n, _, only = spec.partition("@")
    marker = out / f"stopped-r{os.environ.get('RANK', '0')}-s{n}"
    if (only and int(only) != world) or marker.exists():
        return
    real = unbroken.Checkpointer.step

    def step(self, state, **metrics):  # type: ignore[no-untyped-def]
        info = real(self, state, **metrics)
        if self.progress.step == int(n) and not marker.exists():
            marker.write_text(str(os.getpid()))
            print(f"stopped after step {n} (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return info

    unbroken.Checkpointer.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    argv = sys.argv[1:]
    given = _take(argv, "--global-batch")
    if given is not None:
        batch = int(given)
        if batch % world:
            sys.exit(f"--global-batch {batch} is not a multiple of the world size {world}")
        argv += ["--batch", str(batch // world)]
    stop = _take(argv, "--stop-after")
    sys.argv[1:] = argv
    out = Path(argv[argv.index("--out") + 1])
    if stop is not None:
        out.mkdir(parents=True, exist_ok=True)
        _stop_after(stop, world, out)
    code: object = 1
    try:
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            # under torchrun the process group exists at every world size, 1 included (dist_train starts
            # it only above 1): the model stays wrapped in DDP, so a job that shrank to one node restores
            # the checkpoint of two (a DDP model's keys are those of DDP, "module.*")
            unbroken.init_distributed("gloo")
        code = dist_train.main()
    except SystemExit as e:
        code = e.code
    finally:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"exit-r{os.environ.get('RANK', '0')}").write_text(str(code))
    sys.exit(code)
