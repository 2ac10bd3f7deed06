"""Recovery of a torchrun job after a rank's process kill: cold workers against warm ones, in one run.

The job: 2 ranks (``--standalone --nproc-per-node 2``, gloo, CPU), DDP of a small MLP, a ``ResumableLoader``,
``unbroken.Checkpointer(save_every=5)``, ``unbroken.init_distributed()``. Rank 1's training process holds at
steps 12, 27, 42... (``--kills``: 3) and is SIGKILLed there; torchrun (``--max-restarts``) restarts both
workers, which resume from the step-10 (25, 40...) checkpoint. Configurations:

* ``cold``: ``torchrun ... train.py``: each restart a new interpreter, ``import torch``...;
* ``warm``: ``torchrun ... -m unbroken.launch.worker train.py``: each restarted worker handed to a spare of
  the node's server (the kill comes once both replacement spares are ready), the spares forked from the
  server's forker (``src/unbroken/launch/forker.py``);
* ``warm-exec``: the same with ``UNBROKEN_SPARES_FORK=0``: each spare a new interpreter importing torch.

Per kill: **restored** = from the kill to the later of the two ranks' ``restore()`` returning (torchrun's
failure detection, stopping the other rank, the new round's rendezvous, the workers' start, the process
group, the restore); **next 10 steps** = from rank 1's restore to its tenth step after it (against the same
for its first ten steps: what the replacement spares' start takes from the training beside it);
**spares ready** = from the kill to both replacement spares ready. Per warm configuration: the memory of the
waiting spares (and the forker), proportional set size (a page shared by n processes counts 1/n) and
resident. Medians, and the final parameters of every configuration compared (exactness).

    python benchmarks/bench_warm_restart_torchrun.py [--kills 3] [--modes cold,warm,warm-exec] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_warm_restart_torchrun import START, STEP1, TRAIN, parent_of, server_folders, stop_servers, wait_ready
from unbroken.launch.worker import status

MODES = ("cold", "warm", "warm-exec")


def memory(tmp: Path) -> dict[str, float]:
    """MB of the node's waiting spares and their forker: proportional (Pss) and resident (Rss)."""
    folder = server_folders(tmp)[0]
    state = status(str(folder))
    assert state is not None
    pids = [int(p) for p in state["spares"]]
    parents = {parent_of(p) for p in pids} - {int(state["pid"])}  # the forker, if the spares were forked
    out = {"pss_mb": 0.0, "rss_mb": 0.0, "processes": len(pids) + len(parents)}
    for pid in [*pids, *parents]:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("Pss", "Rss"):
                out[f"{name.lower()}_mb"] += int(value.split()[0]) / 1024
    return {k: round(v, 1) for k, v in out.items()}


RESUMED1 = re.compile(r"rank 1 pid \d+ t [\d.]+ resumed from step (\d+)")


def _ready_after(tmp: Path, since: float, out: list[float]) -> None:
    try:
        wait_ready(tmp, 2, timeout=60)
    except AssertionError:
        return  # the job ended first (after its last kill), and its server with it: not counted
    out.append(time.time() - since)


def job(tmp: Path, mode: str, kills: int) -> dict:
    """Per kill, seconds from the kill to both ranks restored, rank 1's next ten steps, the spares' readiness;
    the final parameters' hash; the spares' memory."""
    warm = mode != "cold"
    folder = tmp / mode
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    holds = [15 * i + 12 for i in range(kills)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_FAULT", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", UNBROKEN_SPARES_DIR=str(tmp / "spares"),
               HOLD_AT=",".join(map(str, holds)), STEP_SLEEP="0.02",
               UNBROKEN_SPARES_FORK="0" if mode == "warm-exec" else "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={kills}", *(["-m", "unbroken.launch.worker"] if warm else []), "train.py",
           str(folder / "run"), str(15 * kills + 10), str(folder / "final")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=folder)
    assert proc.stdout is not None
    pid1, killed_at, resumed, out = 0, 0.0, [], []
    restored: list[float] = []
    next10: list[float] = []
    first10: list[float] = []
    spares_ready: list[float] = []
    watchers: list[threading.Thread] = []
    mem: dict[str, float] = {}
    start1, begin = 0.0, -1  # rank 1's restore (or fresh start) and the step it began from (-1: counted)
    for line in proc.stdout:  # two ranks print at once (``-u``: a line and its newline are two writes)
        now = time.time()
        out.append(line)
        for rank, pid, t, how in START.findall(line):
            if rank == "1":
                pid1, start1 = int(pid), float(t)
                found = RESUMED1.search(line)
                begin = int(found.group(1)) if found else 0
            if how == "resumed" and killed_at:
                resumed.append(float(t))
                if len(resumed) == 2:
                    restored.append(max(resumed) - killed_at)
                    if warm:  # the replacements were asked for by now: until both are ready (not blocking the reads)
                        watchers.append(threading.Thread(target=_ready_after, args=(tmp, killed_at, spares_ready)))
                        watchers[-1].start()
                    killed_at, resumed = 0.0, []
        for step in STEP1.findall(line):
            s = int(step)
            if begin >= 0 and s == begin + 10 and start1:
                (first10 if begin == 0 else next10).append(now - start1)
                begin = -1
            if s in holds:
                holds.remove(s)
                deadline = time.monotonic() + 60
                while not (folder / f"run.held-{step}").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                if warm:
                    wait_ready(tmp, 2)
                    mem = mem or memory(tmp)
                killed_at = time.time()
                os.kill(pid1, signal.SIGKILL)
    for watcher in watchers:
        watcher.join()
    if proc.wait(timeout=600) != 0:
        raise SystemExit("".join(out))
    if warm and sum(line.count("warm start") for line in out) != 2 * (kills + 1):  # (two workers' lines may join)
        raise SystemExit("not every worker started warm:\n" + "".join(out))
    return {"restored_s": restored, "median_s": statistics.median(restored), "next10_s": next10,
            "first10_s": first10, "spares_ready_s": spares_ready, "memory": mem,
            "final": (folder / "final").read_text()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            for name in args.modes.split(","):
                load = os.getloadavg()[0]
                r = results[name] = dict(job(tmp, name, args.kills), load_before=load)
                stop_servers(tmp)
                med = statistics.median
                line = (f"{name:9s} kill -> both ranks restored: median {r['median_s']:.2f} s "
                        f"({', '.join(f'{t:.2f}' for t in r['restored_s'])}); rank 1's next 10 steps "
                        f"{med(r['next10_s']):.2f} s (first 10: {med(r['first10_s']):.2f})")
                if r["spares_ready_s"]:
                    m = r["memory"]
                    line += (f"; spares ready {med(r['spares_ready_s']):.2f} s after the kill; waiting spares "
                             f"{m['pss_mb']:.0f} MB Pss / {m['rss_mb']:.0f} MB Rss in {m['processes']:.0f} processes")
                print(line + f"; load average {load:.1f} before", flush=True)
        finally:
            stop_servers(tmp)
    finals = {r["final"] for r in results.values()}
    if "cold" in results:
        for name in results:
            if name != "cold":
                print(f"{name} / cold: {results[name]['median_s'] / results['cold']['median_s']:.2f}")
    print(f"final parameters {'equal' if len(finals) == 1 else 'DIFFER'} ({', '.join(results)})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if len(finals) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
