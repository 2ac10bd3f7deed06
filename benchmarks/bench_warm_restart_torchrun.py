"""Recovery of a torchrun job after a rank's process kill: cold workers against warm ones, in one run.

The job: 2 ranks (``--standalone --nproc-per-node 2``, gloo, CPU), DDP of a small MLP, a ``ResumableLoader``,
``unbroken.Checkpointer(save_every=5)``, ``unbroken.init_distributed()``. Rank 1's training process holds at
steps 12, 27, 42... (``--kills``: 3) and is SIGKILLed there; torchrun (``--max-restarts``) restarts both
workers, which resume from the step-10 (25, 40...) checkpoint. Configurations:

* ``cold``: ``torchrun ... train.py``: each restart a new interpreter, ``import torch``...;
* ``warm``: ``torchrun ... -m unbroken.launch.worker train.py``: each restarted worker handed to a spare of
  the node's server (the kill comes once both replacement spares are ready).

Per kill: **restored** = from the kill to the later of the two ranks' ``restore()`` returning (torchrun's
failure detection, stopping the other rank, the new round's rendezvous, the workers' start, the process
group, the restore). Medians, and the final parameters of both configurations compared (exactness).

    python benchmarks/bench_warm_restart_torchrun.py [--kills 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_warm_restart_torchrun import START, STEP1, TRAIN, stop_servers, wait_ready


def job(tmp: Path, warm: bool, kills: int) -> tuple[list[float], str]:
    """Per kill, seconds from the kill to both ranks restored; and the final parameters' hash."""
    folder = tmp / ("warm" if warm else "cold")
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    holds = [15 * i + 12 for i in range(kills)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_FAULT", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", UNBROKEN_SPARES_DIR=str(tmp / "spares"),
               HOLD_AT=",".join(map(str, holds)), STEP_SLEEP="0.02")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={kills}", *(["-m", "unbroken.launch.worker"] if warm else []), "train.py",
           str(folder / "run"), str(15 * kills + 10), str(folder / "final")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=folder)
    assert proc.stdout is not None
    pid1, killed_at, resumed, out, times = 0, 0.0, [], [], []
    for line in proc.stdout:  # two ranks print at once (``-u``: a line and its newline are two writes)
        out.append(line)
        for rank, pid, t, how in START.findall(line):
            if rank == "1":
                pid1 = int(pid)
            if how == "resumed" and killed_at:
                resumed.append(float(t))
                if len(resumed) == 2:
                    times.append(max(resumed) - killed_at)
                    killed_at, resumed = 0.0, []
        for step in STEP1.findall(line):
            if int(step) in holds:
                holds.remove(int(step))
                deadline = time.monotonic() + 60
                while not (folder / f"run.held-{step}").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                if warm:
                    wait_ready(tmp, 2)
                killed_at = time.time()
                os.kill(pid1, signal.SIGKILL)
    if proc.wait(timeout=600) != 0:
        raise SystemExit("".join(out))
    if warm and sum("warm start" in line for line in out) != 2 * (kills + 1):
        raise SystemExit("not every worker started warm:\n" + "".join(out))
    return times, (folder / "final").read_text()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            for name in ("cold", "warm"):
                load = os.getloadavg()[0]
                got, final = job(tmp, name == "warm", args.kills)
                results[name] = {"restored_s": got, "median_s": statistics.median(got), "final": final,
                                 "load_before": load}
                print(f"{name:5s} kill -> both ranks restored: median {statistics.median(got):.2f} s  "
                      f"({', '.join(f'{t:.2f}' for t in got)}; load average {load:.1f} before)", flush=True)
        finally:
            stop_servers(tmp)
    exact = results["cold"]["final"] == results["warm"]["final"]
    ratio = results["warm"]["median_s"] / results["cold"]["median_s"]
    print(f"warm / cold: {ratio:.2f}; final parameters {'equal' if exact else 'DIFFER'} (cold vs warm)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
