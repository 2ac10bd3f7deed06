"""Goodput under failures: a multi-rank job under torchrun with failures injected at a fixed rate.

The job (``goodput_worker.py``) is bench_train_overhead.py's GPT-like model, by default 2
layers, dim 256, vocab 8192, seq 64, batch 4 per rank: 5.8M parameters, a checkpoint of ~70 MB
(parameters + AdamW moments), ~140 ms a step on 2 idle cores, in DistributedDataParallel over
gloo on ``--ranks`` (2) processes of one torch thread each. Configurations, in one run:

* ``dcp``: a careful hand-written loop (``goodput_dcp.py``): ``dcp.save`` every
  ``--save-every`` steps, rename-committed, restored from the newest complete one with
  ``dcp.load``, the data position a step counter restored by skipping batches, RNGs saved;
  ``dcp-async`` (with ``--configs``): the same with ``dcp.async_save``.
* ``disk``: ``unbroken.Checkpointer(run, save_every=N)``, ``unbroken.init_distributed()``, a
  ``ResumableLoader`` (``goodput_unbroken.py``).
* ``ram``: ``Checkpointer(run, save_every=1, ram=unbroken.RamTier(keep_last=2, persist_every=N))``.
* ``inproc``: ``disk`` inside ``ckpt.recover(train, state, on=(InjectedFault,))`` (exceptions only).
* ``warm``: ``disk``, its workers started by ``torchrun ... -m unbroken.launch.worker`` (restarts from warm
  spares: ``docs/faults.md``); ``warm-CONFIG`` is any other unbroken configuration so started (``warm-auto``,
  ``warm-ram-auto``).
* ``auto``: ``Checkpointer(run, save_every="auto")``: the interval chosen from the saves' measured blocking
  time and the run's failures (:class:`unbroken.policies.AutoInterval`, its 24 h prior until the first, or
  ``--mtbf-prior-hours``).
* ``ram-auto``: the RAM tier with ``save_every="auto"`` (the RAM saves' interval chosen the same way; every
  ``N``-th RAM checkpoint persisted to disk).

``CONFIG@N`` runs a configuration with a save every ``N`` steps instead of ``--save-every`` (``disk@10``,
``dcp@25``): ``--configs auto,disk@10,disk@25,disk@50,disk@100`` compares ``auto`` with a sweep of fixed
intervals in one run.

``ram`` and ``inproc`` are reported "not available" when this unbroken lacks ``RamTier`` or
``Checkpointer.recover``. Failure kinds: ``none`` (the baseline), ``kill`` (rank 1 SIGKILLed from
outside; ``torchrun --max-restarts`` restarts the group), ``exception`` (every rank raises inside
the same step; the process exits and torchrun restarts it, or ``recover`` restores in place) and
``node`` (two torchrun agents in two network namespaces, one rank each; every process of node 1
SIGKILLed at once and its shared memory wiped (each node's RAM tier has its own folder in
/dev/shm: a lost machine's memory is gone), the survivor fails, and the job is launched again on
both nodes, as a scheduler requeues it: needs root and iproute2, else skipped with the reason). A failure is
injected every ``--interval`` seconds of wall time (the first one an interval after the launch), once the job
has made a new step since the previous one, and not in the last 3 steps; ``KIND@S`` in ``--kinds`` is that kind
every ``S`` seconds (``--kinds kill@60,kill@600``: two rates in one run, sharing their uninterrupted jobs).
Every run trains ``--steps`` steps; a run's numbers come from the ranks' event records (goodput_report.py says how).
The intervals the ``auto`` configurations chose are read from each job's run index before its folder is removed
(``intervals`` in the JSON, and a table).

After each kill, where the restart went (``goodput_timeline.py``): torchrun's agent lines (its
output is time-stamped as it is read), the survivor's exit, and the new rank 0's phases, as
segments that add up to restart + restore. ``--base-src DIR`` also runs every unbroken
configuration on the ``unbroken`` package in DIR (``<config>-base``), job after job with the
current one: old against new in one run, under the same load.

Exactness: each interrupted run's final parameters and AdamW state (SHA-256 of the bytes) must
equal the same configuration's uninterrupted run (with ``--one-reference``: the one uninterrupted job of
the first unbroken configuration, for all of them — they train the same steps on the same data —, which
halves the machine time of a long job at a rare failure rate); reported for every configuration, required
(exit status 1 otherwise) for unbroken's.

    python benchmarks/bench_goodput.py [--steps 600] [--interval 60] [--save-every 50] [--ranks 2]
        [--configs dcp,disk,ram,inproc] [--kinds none,kill,exception,node]
        [--layers 2 --dim 256 --seq 64 --batch 4 --vocab 8192] [--monitor-interval 0.1]
        [--base-src OLD/src] [--dir D] [--json F] [--plot F.png] [--markdown F]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from goodput_report import chosen_intervals, intervals_table, metrics, plot, read_events, table  # noqa: E402
from goodput_timeline import breakdown, median_table  # noqa: E402

WORKER = str(HERE / "goodput_worker.py")
UNBROKEN = ("disk", "auto", "ram", "ram-auto", "inproc")
CONFIGS = ("dcp", "dcp-async", *UNBROKEN, "warm", *(f"warm-{c}" for c in UNBROKEN if c not in ("disk", "inproc")))
WARM = "warm"  # the prefix of a configuration whose workers start from warm spares
KINDS = ("none", "kill", "exception", "node")
MODEL = (("layers", 2), ("dim", 256), ("seq", 64), ("batch", 4), ("vocab", 8192))
RDZV_PORT = 29400
BASE = "-base"  # a configuration run on the unbroken of --base-src (the comparison's old side)


def kind_of(config: str) -> str:
    """The configuration without its ``-base`` suffix and its ``@N`` save interval (``disk@25-base``: ``disk``)."""
    return config.removesuffix(BASE).partition("@")[0]


def _every_ok(config: str) -> bool:
    every = config.removesuffix(BASE).partition("@")[2]
    return not every or (every.isdigit() and int(every) > 0
                         and kind_of(config) in ("dcp", "dcp-async", "disk", "warm", "ram", "ram-auto",
                                                 "warm-ram", "warm-ram-auto"))


def worker_config(config: str) -> tuple[bool, str]:
    """Whether ``config`` starts its workers from warm spares, and the worker's own configuration
    (``warm-ram-auto@50``: ``(True, "ram-auto")``; ``warm``: ``(True, "disk")``)."""
    kind = kind_of(config)
    if kind == WARM or kind.startswith(WARM + "-"):
        return True, kind.removeprefix(WARM).removeprefix("-") or "disk"
    return False, kind


def _kind_ok(kind: str) -> bool:
    try:
        rate_of(kind, 1.0)
    except ValueError:
        return False
    return True


def references(configs: list[str], one: bool) -> dict[str, str]:
    """The configuration whose uninterrupted job each configuration's interrupted ones must equal: itself, or with
    ``one`` (``--one-reference``) the first unbroken configuration of the current package for every such
    configuration (the same steps on the same data: the same final state, whatever the saves and restarts), the
    first ``-base`` one for the ``-base`` ones; each dcp configuration its own."""
    first: dict[str, str] = {}
    out = {}
    for c in configs:
        family = c if not one or c.startswith("dcp") else "base" if c.endswith(BASE) else "unbroken"
        out[c] = first.setdefault(family, c)
    return out


def unavailable(config: str, kind: str) -> str | None:
    import unbroken

    warm, config = worker_config(config)
    if warm and importlib.util.find_spec("unbroken.launch.worker") is None:
        return "unbroken.launch.worker (warm restarts under torchrun) is not in this unbroken"
    if config.startswith("ram") and not hasattr(unbroken, "RamTier"):
        return "unbroken.RamTier is not in this unbroken"
    if config.endswith("auto") and not _has_auto():
        return "save_every='auto' is not in this unbroken"
    if config == "inproc" and not hasattr(unbroken.Checkpointer, "recover"):
        return "unbroken.Checkpointer.recover is not in this unbroken"
    return None


def _has_auto() -> bool:
    try:
        from unbroken.policies import AutoInterval  # noqa: F401
    except ImportError:
        return False
    return True


def node_reason() -> str | None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from netns import available

    return available()


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Tail:
    """The events the ranks have appended so far (read incrementally)."""

    def __init__(self, out: Path, ranks: int) -> None:
        self.paths = [out / f"events-r{r}.jsonl" for r in range(ranks)]
        self.pos = [0] * ranks
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        for i, p in enumerate(self.paths):
            with contextlib.suppress(FileNotFoundError), open(p) as f:
                f.seek(self.pos[i])
                chunk = f.read()
                complete = chunk[:chunk.rfind("\n") + 1]
                self.pos[i] += len(complete)
                self.events += [json.loads(line) for line in complete.splitlines()]
        return self.events


def ended(pid: int) -> bool:
    """True once process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:stat.rfind(")") + 3] in ("Z", "X")


class ExitWatch:
    """When each rank's process of the moment ends (polled every 5 ms from a thread): the timeline's
    'survivor gone'."""

    def __init__(self, out: Path, ranks: int) -> None:
        self.pids = {r: int((out / f"pid-r{r}").read_text()) for r in range(ranks)}
        self.ended: dict[int, float] = {}
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def start(self) -> ExitWatch:
        self.thread.start()
        return self

    def poll(self, limit_s: float = 120.0) -> None:
        until = time.time() + limit_s
        while len(self.ended) < len(self.pids) and time.time() < until:
            for r, pid in self.pids.items():
                if r not in self.ended and ended(pid):
                    self.ended[r] = time.time()
            time.sleep(0.005)


class Job:
    """The training job: one ``torchrun --standalone``, or one agent per network-namespace node."""

    def __init__(self, a: argparse.Namespace, config: str, base: Path, cluster: Any, log: Any) -> None:
        self.a, self.base, self.cluster, self.log = a, base, cluster, log
        model = [f"--{k}={getattr(a, k)}" for k, _ in MODEL]
        every = config.removesuffix(BASE).partition("@")[2]  # "disk@25": disk, a save every 25 steps
        warm, name = worker_config(config)
        spares = ["-m", "unbroken.launch.worker"] if warm else []  # restarted from warm spares
        prior = ["--mtbf-prior-hours", str(a.mtbf_prior_hours)] if a.mtbf_prior_hours and name.endswith("auto") else []
        self.argv = [*spares, WORKER, "--config", name, "--run-dir", str(base / "run"),
                     "--out", str(base / "out"), "--steps", str(a.steps), "--save-every", every or str(a.save_every),
                     *prior, *model]
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if config.endswith(BASE):  # the same configuration on the unbroken of --base-src
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [a.base_src, os.environ.get("PYTHONPATH")]))
        self.env["LOGLEVEL"] = "INFO"  # torchrun's agent says when it stops, rendezvouses and starts workers
        self.procs: list[Any] = []
        self.copier: threading.Thread | None = None
        self.launches = 0

    def launch(self) -> None:
        self.launches += 1
        run = [sys.executable, "-m", "torch.distributed.run"]
        if self.cluster is None:
            cmd = [*run, "--standalone", f"--nproc-per-node={self.a.ranks}", "--max-restarts=1000",
                   f"--monitor-interval={self.a.monitor_interval}", *self.argv]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
            self.procs = [proc]
            self.copier = threading.Thread(target=self.copy, args=(proc.stdout,), daemon=True)
            self.copier.start()
            return
        from netns import IFNAME

        host = self.cluster.nodes[0]
        self.procs = []
        for i in (1, 0):
            node = self.cluster.nodes[i]
            env = dict(self.env, GLOO_SOCKET_IFNAME=IFNAME, UNBROKEN_RAM_ROOT=str(self.ram_root(i)))
            cmd = [*run, "--nnodes=2", f"--nproc-per-node={self.a.ranks // 2}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={host.addr}:{RDZV_PORT}", f"--rdzv-id=goodput{self.launches}",
                   f"--rdzv-conf=is_host={int(i == 0)},last_call_timeout=1,keep_alive_interval=1,join_timeout=120",
                   f"--local-addr={node.addr}", "--max-restarts=0", *self.argv]
            self.procs.append(node.start(cmd, env, on_line=lambda line: self.log.write(line)))

    def ram_root(self, node: int) -> Path:
        """Node ``node``'s shared memory (the namespaces share /dev/shm: each node gets a folder of
        its own in it, which a node loss wipes, as a lost machine's memory is gone)."""
        return Path(self.a.ram_root or "/dev/shm") / f"unbroken-bench-{os.getpid()}-{self.base.name}-node{node}"

    def lose_memory(self, node: int) -> None:
        shutil.rmtree(self.ram_root(node), ignore_errors=True)

    def copy(self, stream: Any) -> None:
        """torchrun's output into the log, each line stamped with the time it was read (the timeline)."""
        for raw in stream:
            self.log.write(f"{time.time():.3f} {raw.decode(errors='replace')}")
            self.log.flush()

    def codes(self) -> list[int | None]:
        return [getattr(p, "popen", p).poll() for p in self.procs]

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.kill_all()
            for i in (0, 1):
                self.lose_memory(i)
            return
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if self.copier is not None:
            self.copier.join(10)
        for pid in (self.base / "out").glob("pid-r*"):  # torchrun's workers have their own sessions
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid.read_text()), signal.SIGKILL)


def rate_of(kind: str, default: float) -> tuple[str, float]:
    """A failure kind and its seconds between failures: ``kill@600`` is ``("kill", 600.0)``, ``kill`` the ``default``
    (``--interval``); ``ValueError`` for another kind or rate."""
    name, at, rate = kind.partition("@")
    seconds = float(rate) if at else default
    if name not in KINDS or (at and (name == "none" or not seconds > 0)):
        raise ValueError(kind)
    return name, seconds


def run_one(a: argparse.Namespace, config: str, named: str, tmp: Path, cluster: Any) -> dict[str, Any]:
    """One job of ``config`` under failures of kind ``named`` (``kill``, ``kill@600``: its own rate); its metrics and
    final digest."""
    kind, interval = rate_of(named, a.interval)
    base = tmp / f"{config}-{named}"
    out = base / "out"
    out.mkdir(parents=True)
    failures: list[float] = []
    exits: list[ExitWatch] = []
    with open(base / "log.txt", "w") as log:
        job = Job(a, config, base, cluster, log)
        release = out / "released"  # --hold-for-failures: the jobs wait before their last steps until it exists
        if a.hold_for_failures and kind != "none":
            job.env["GOODPUT_RELEASE"] = str(release)
        tail = Tail(out, a.ranks)
        load0, launched = loadavg(), time.time()
        job.launch()
        next_at, pending, deadline = launched + interval, None, launched + a.timeout
        planned = launched
        try:
            while True:
                codes = job.codes()
                events = tail.poll()
                steps = [e for e in events if e["ev"] == "step"]
                now = time.time()
                if cluster is not None and None in codes and any(c is not None for c in codes):
                    survivor = next(p for p, c in zip(job.procs, codes, strict=True) if c is None)
                    if survivor.wait(60) is None:  # the survivor must notice by itself; else it is stuck
                        raise RuntimeError(f"the surviving agent did not end within 60 s:\n{job.log}")
                    codes = job.codes()
                if all(c is not None for c in codes):
                    if all(c == 0 for c in codes) or cluster is None:
                        break
                    job.launch()  # a node was lost: the scheduler launches the job again on both nodes
                    continue
                if now > deadline:
                    raise RuntimeError(f"{config}/{kind}: not done within {a.timeout} s (see {base / 'log.txt'})")
                if pending is not None:  # an exception was planned: when it fires, it is the failure
                    fired = [e["t"] for e in events
                             if e["ev"] == "fault" and e["step"] >= pending and e["t"] >= planned]
                    if fired:
                        failures.append(min(fired))
                        pending, next_at = None, min(fired) + interval
                last = {e["rank"]: e["step"] for e in steps}  # where each rank is now
                latest = max(last.values(), default=0)
                since = failures[-1] if failures else launched
                done_before = max((e["step"] for e in steps if e["t"] <= since), default=0)
                progressed = any(e["t"] > since and e["rank"] == 0 and e["step"] > done_before for e in steps)
                if kind != "none" and pending is None and now >= next_at and progressed and latest < a.steps - 3 \
                        and len(failures) < (a.max_failures if a.max_failures is not None else a.steps):
                    if kind == "exception":  # at the first step from latest + 2 on that the ranks see it
                        pending, planned = latest + 2, time.time()
                        (out / "fault-at").write_text(str(pending))
                    elif kind == "kill":
                        watch = ExitWatch(out, a.ranks)
                        failures.append(time.time())
                        os.kill(int((out / "pid-r1").read_text()), signal.SIGKILL)
                        exits.append(watch.start())
                        next_at = failures[-1] + interval
                    else:
                        failures.append(time.time())
                        cluster.nodes[1].kill_all()
                        job.lose_memory(1)  # a replacement machine: nothing of node 1 is left
                        next_at = failures[-1] + interval
                    if a.max_failures is not None and len(failures) + (pending is not None) >= a.max_failures:
                        release.touch()  # every failure asked for is on its way: a held job may finish
                time.sleep(0.05)
        finally:
            job.stop()
    codes = job.codes()
    final = out / "final.json"
    if not final.exists():
        raise RuntimeError(f"{config}/{named}: the job ended (exit {codes}) without finishing; see {base / 'log.txt'}")
    m = metrics(read_events(out), failures, launched, a.steps)
    if kind == "kill":
        for w in exits:
            w.thread.join(5)
        m["timeline"] = breakdown(failures, [w.ended.get(0) for w in exits], read_events(out), base / "log.txt")
    m.update(config=config, kind=named, interval_s=interval if kind != "none" else None, launches=job.launches,
             final_sha256=json.loads(final.read_text())["sha256"],
             loadavg=[load0, loadavg()])
    if intervals := chosen_intervals(base / "run"):  # auto's choices: the run index goes with the folder
        m["intervals"] = intervals
    shutil.copy(base / "log.txt", tmp / f"log-{config}-{named}.txt")
    for ev in out.glob("events-r*.jsonl"):
        shutil.copy(ev, tmp / f"{ev.stem}-{config}-{named}.jsonl")
    shutil.rmtree(base)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for k, v in MODEL:
        ap.add_argument(f"--{k}", type=int, default=v, help=f"model size, as bench_train_overhead.py (default {v})")
    ap.add_argument("--steps", type=int, default=600, help="steps per job (default 600: ~90 s without failures)")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between failures (default 60)")
    ap.add_argument("--save-every", type=int, default=50, help="steps between disk checkpoints (default 50)")
    ap.add_argument("--mtbf-prior-hours", type=float, default=None,
                    help="the auto configurations' AutoInterval(mtbf_hours=...) (default: the library's)")
    ap.add_argument("--ram-root", default=None, help="where the nodes' RAM tiers live for 'node' (default /dev/shm)")
    ap.add_argument("--ranks", type=int, default=2, help="processes (default 2; split over 2 nodes for 'node')")
    ap.add_argument("--configs", default="dcp,disk,ram,inproc", help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"of {','.join(KINDS)}; KIND@S: that kind at a failure every S seconds (kill@60,kill@600: "
                         "two rates in one run)")
    ap.add_argument("--monitor-interval", type=float, default=0.1,
                    help="torchrun --monitor-interval for every configuration (default 0.1, torchrun's own)")
    ap.add_argument("--base-src", metavar="DIR",
                    help="also run every unbroken configuration on the unbroken package in DIR (e.g. an "
                         "older checkout's src/), reported as '<config>-base', job after job with the current one")
    ap.add_argument("--one-reference", action="store_true",
                    help="run the uninterrupted ('none') job once for all unbroken configurations (the first of "
                         "them) and once per dcp configuration, instead of once per configuration: every unbroken "
                         "configuration trains the same steps on the same data, so each interrupted run must equal "
                         "that one job bitwise (for long jobs: a rare failure rate costs half the machine time)")
    ap.add_argument("--max-failures", type=int, default=None, help="at most this many failures a job")
    ap.add_argument("--hold-for-failures", action="store_true",
                    help="with --max-failures: a job with failures to inject waits before step steps - 3 until "
                         "all are on their way (for tests on a loaded machine: the wait counts in the wall time)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a job may take before it is killed")
    ap.add_argument("--dir", help="where the jobs run (default: the temporary folder)")
    ap.add_argument("--keep-logs", action="store_true", help="keep each job's log and event records in --dir")
    ap.add_argument("--json", metavar="FILE", help="also write the results as one JSON object")
    ap.add_argument("--plot", metavar="FILE", help="also draw goodput and recovery time (PNG)")
    ap.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the jobs and clean up on the way out
    configs, kinds = a.configs.split(","), a.kinds.split(",")
    bad = [c for c in configs if kind_of(c) not in CONFIGS or not _every_ok(c)] + [k for k in kinds if not _kind_ok(k)]
    if bad:
        ap.error(f"unknown: {bad}")
    if a.base_src:
        if not (Path(a.base_src) / "unbroken" / "__init__.py").is_file():
            ap.error(f"--base-src {a.base_src}: no unbroken package there (pass the folder that holds unbroken/)")
        a.base_src = str(Path(a.base_src).resolve())
        configs = [c for config in configs
                   for c in ((config,) if config.startswith("dcp") else (config + BASE, config))]
    if a.hold_for_failures and a.max_failures is None:
        ap.error("--hold-for-failures needs --max-failures (the failures a job waits for)")
    if a.ranks < 2 or a.ranks % 2:
        ap.error("--ranks must be even and at least 2 (a rank is killed; 'node' splits them over 2 nodes)")
    if "none" not in kinds:
        kinds.insert(0, "none")  # the reference for exactness and the ratios (one for every rate)
    reference = references(configs, a.one_reference)
    sys.path.insert(0, str(HERE.parent / "tests"))
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-goodput-", dir=a.dir))
    rows: list[dict[str, Any]] = []
    started = time.time()
    skipped: dict[str, str] = {}
    try:
        for named in kinds:  # node losses last
            kind = rate_of(named, a.interval)[0]
            cluster = None
            if kind == "node":
                if (why := node_reason()) is not None:
                    skipped["node"] = why
                    print(f"[node] skipped: {why}", file=sys.stderr, flush=True)
                    continue
                from netns import Cluster

                cluster = Cluster(2)
            try:
                for config in configs:
                    if kind == "none" and reference[config] != config:
                        continue  # its reference is another configuration's uninterrupted job
                    if (kind_of(config) == "inproc" and kind not in ("none", "exception")) or (
                            worker_config(config)[0] and kind == "node"):  # (warm: one node's spares; not measured)
                        continue
                    if not config.endswith(BASE) and (why := unavailable(kind_of(config), kind)) is not None:
                        rows.append({"config": config, "kind": named, "unavailable": why})
                        continue
                    print(f"[{config} / {named}]", file=sys.stderr, flush=True)
                    r = run_one(a, config, named, tmp, cluster)
                    print(f"  goodput {r['goodput']:.3f}, {r['failures']} failures, recovery "
                          f"{r['median_recovery_s']}, redone {r['steps_redone']}", file=sys.stderr, flush=True)
                    rows.append(r)
            finally:
                if cluster is not None:
                    cluster.close()
    finally:
        if not a.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
    ref = {r["config"]: r["final_sha256"] for r in rows if r["kind"] == "none" and "final_sha256" in r}
    for r in rows:
        if "final_sha256" in r:
            r["exact"] = None if r["kind"] == "none" else r["final_sha256"] == ref.get(reference[r["config"]])
    from bench_train_overhead import machine

    loads = [x for r in rows for x in r.get("loadavg", [])]

    info = machine(Path(a.dir or tempfile.gettempdir()))
    title = (f"{a.ranks} ranks (DDP, gloo, 1 thread each), model {a.layers} layers dim {a.dim} seq {a.seq} "
             f"batch {a.batch}/rank vocab {a.vocab}; {a.steps} steps a job, disk save every {a.save_every}, "
             f"a failure every {a.interval:g} s (KIND@S: every S s); took {time.time() - started:.0f} s; "
             "1-min load average "
             f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} (at the start and end of each job)")
    print(f"\n{title}\nMachine: {info}\n\n{table(rows, md=False)}")
    if chosen := intervals_table(rows, md=False):
        print(f"\nThe intervals the auto configurations chose (their run index):\n{chosen}")
    if timeline := median_table(rows, md=False):
        print(f"\nWhere a restart after a rank SIGKILL goes (median seconds per segment):\n{timeline}")
    for k, why in skipped.items():
        print(f"\n{k}: skipped: {why}")
    wrong = [f"{r['config']}/{r['kind']}" for r in rows if r.get("exact") is False]
    print("\nExactness (final parameters + AdamW state vs the same configuration's uninterrupted run): " +
          ("every interrupted run bitwise equal" if not wrong else "DIFFERENT: " + ", ".join(wrong)))
    if a.json:
        doc = {"title": title, "machine": info, "args": vars(a), "skipped": skipped, "rows": rows}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(f"{title}\n\nMachine: {info}\n\n{table(rows, md=True)}\n\n"
                                    f"{intervals_table(rows, md=True)}\n\n{median_table(rows, md=True)}\n")
    if a.plot:
        plot(rows, a.plot, title)
    if any(not w.startswith("dcp") and BASE + "/" not in w for w in wrong):
        sys.exit(1)


if __name__ == "__main__":
    main()
