"""One rank of bench_goodput.py's training job (run under torchrun); see that script's docstring.

    torchrun --nproc-per-node 2 --max-restarts 99 benchmarks/goodput_worker.py --config disk \
        --run-dir RUN --out OUT --steps 400 --save-every 20 [--layers 2 --dim 256 ...]

The model, its AdamW and the synthetic token dataset are bench_train_overhead.py's (``build``),
wrapped in DistributedDataParallel over gloo. Every rank appends one JSON line per event to
``OUT/events-r<rank>.jsonl``: ``launch`` (this script's first line; ``spawned``: when the kernel
started the process), ``phase`` (``what``: ``import torch``, ``import unbroken``, ``process
group``, ``model``: each done; for the restart timeline), ``ready`` (imports, process
group, model, optimizer and data built), ``restored`` (the checkpoint is in place: the step it
holds), ``step`` (``step``, ``t0`` before the batch is fetched, ``t1`` after ``optimizer.step()``,
``redone``: this rank had finished that step before), ``fault`` (an injected exception is
raised) and ``done``. Times are ``time.time()``. At the end rank 0 writes ``OUT/final.json``:
the SHA-256 of every parameter and AdamW moment, bitwise.

An exception is injected at the first step at or after the one ``OUT/fault-at`` names (the file may appear
after the ranks have passed that step: a loaded machine): every rank raises :class:`InjectedFault` before
that step's forward pass (no collective is in flight), once per request (``OUT/fired-<N>-r<rank>``, ``N``
the file's step). The ranks agree on it (one all-reduce of a flag per step, in every configuration alike):
the file may appear between two ranks' checks of the same step, and one rank raising alone cannot be
recovered in the process (docs/faults.md, "Several ranks"). ``GOODPUT_RELEASE`` (``bench_goodput.py
--hold-for-failures``) names a file the ranks wait for, at most two minutes, before step ``steps - 3`` (the
harness injects nothing later).
"""

from __future__ import annotations

import time

T_LAUNCH = time.time()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


class InjectedFault(RuntimeError):
    """The exception bench_goodput.py injects inside a step."""


class Events:
    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"events-r{rank}.jsonl"
        self.rank = rank
        self.done = 0  # the highest step this rank finished in any earlier process or attempt
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                with_step = json.loads(line)
                if with_step.get("ev") == "step":
                    self.done = max(self.done, with_step["step"])
        self.f = open(self.path, "a")

    def __call__(self, ev: str, **kw: object) -> None:
        kw.setdefault("t", time.time())
        self.f.write(json.dumps({"ev": ev, "rank": self.rank, "pid": os.getpid(), **kw}) + "\n")
        self.f.flush()

    def step(self, step: int, t0: float) -> None:
        self("step", step=step, t0=t0, t=time.time(), redone=step <= self.done)
        self.done = max(self.done, step)


class FaultPlan:
    """Raise :class:`InjectedFault` at the step ``OUT/fault-at`` names (once per step number)."""

    def __init__(self, out: Path, rank: int) -> None:
        self.file, self.out, self.rank, self.mtime, self.at = out / "fault-at", out, rank, None, None

    def check(self, step: int, events: Events, steps: int) -> None:
        release = os.environ.get("GOODPUT_RELEASE")
        if release and step == steps - 3:  # (the harness injects until step steps - 4) held until every failure
            # asked for is on its way, bounded
            deadline = time.time() + 120
            while not os.path.exists(release) and time.time() < deadline:
                time.sleep(0.01)
        try:
            mtime: int | None = self.file.stat().st_mtime_ns
        except FileNotFoundError:  # not yet here; another rank may see it already: every rank decides
            mtime = None
        if mtime is not None and mtime != self.mtime:
            self.mtime, self.at = mtime, int(self.file.read_text() or 0)
        fired = self.out / f"fired-{self.at}-r{self.rank}"
        if agreed(self.at is not None and step >= self.at and not fired.exists()):
            fired.touch()
            events("fault", step=step)
            raise InjectedFault(f"injected at step {step} on rank {self.rank}")


def agreed(mine: bool) -> bool:
    """True on every rank if it is True on any (an all-reduce under torchrun; ``mine`` alone otherwise)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    flag = torch.tensor([int(mine)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def started_at() -> float | None:
    """When the kernel started this process (``time.time()`` scale, 10 ms resolution), or None."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rfind(")") + 2:].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def digest(model, opt) -> str:
    import torch

    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy())
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}/{k}".encode())
            h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=["dcp", "dcp-async", "disk", "auto", "ram", "ram-auto", "inproc"],
                   required=True)
    p.add_argument("--mtbf-prior-hours", type=float, default=None)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    for k, v in (("layers", 2), ("dim", 256), ("seq", 64), ("batch", 4), ("vocab", 8192)):
        p.add_argument(f"--{k}", type=int, default=v)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    events = Events(out, rank)
    events("launch", t=T_LAUNCH, spawned=started_at())
    (out / f"pid-r{rank}").write_text(str(os.getpid()))

    import torch

    events("phase", what="import torch")
    import unbroken
    from bench_train_overhead import build

    events("phase", what="import unbroken")
    torch.set_num_threads(1)
    if a.config.startswith("dcp"):
        import goodput_dcp

        goodput_dcp.init()
    else:
        unbroken.init_distributed("gloo")
    events("phase", what="process group")
    model, opt, ds = build(a.layers, a.dim, a.seq, a.vocab)
    model = torch.nn.parallel.DistributedDataParallel(model)
    events("phase", what="model")
    faults = FaultPlan(out, rank)
    if a.config.startswith("dcp"):
        import goodput_dcp

        loop = goodput_dcp.Loop(model, opt, ds, a, events, faults, async_save=a.config == "dcp-async")
    else:
        import goodput_unbroken

        loop = goodput_unbroken.Loop(model, opt, ds, a, events, faults, InjectedFault)
    loop.run()
    if rank == 0:
        (out / "final.json").write_text(json.dumps({"sha256": digest(model, opt), "step": loop.step_no()}))
    events("done")
    # Leave without tearing the process group down: on gloo, after a restart, a rank sometimes
    # waited for ever in destroy_process_group() once its peer had exited (seen in the DCP loop);
    # the job's work is done and recorded, and the benchmark measures nothing after it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
