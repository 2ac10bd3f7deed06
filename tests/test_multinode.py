"""Several nodes on one machine: ``torchrun --nnodes 2`` (c10d rendezvous) across network namespaces.

Each node is a network namespace (tests/netns.py) with its own address on a private bridge; one
torchrun agent runs on each, rendezvousing at node 0's address; the run folder (``tmp_path``) is the
cluster's shared filesystem. The job is tests/dist_train.py (DDP over gloo, a ResumableLoader with
per-sample augmentation, dropout, AdamW + LambdaLR) through tests/multinode_train.py, one process
per node. What is compared, bitwise, with the uninterrupted 2-node run: the final parameters and
optimizer state, and every rank's loss and samples at every step.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from netns import IFNAME, Cluster, Proc, available, ended, links, namespaces
from test_distributed import losses, run, same_final
from unbroken.faults import EXIT_PREEMPTED
from unbroken.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).parent / "multinode_train.py")
STEPS, SAVE_EVERY, GLOBAL_BATCH = 16, 4, 16
PORT = 29400  # of the rendezvous, on node 0's address: every cluster is a network of its own
RDZV = "last_call_timeout=3,keep_alive_interval=1,join_timeout=120"
"""An elastic round completes 3 s after its minimum of nodes joined; a lost node is dropped after
3 missed heartbeats of 1 s (torch's defaults: 30 s and 15 s)."""
DEADLINE = 300.0  # seconds a launch may take before the test fails (only so that nothing hangs)
HOST_ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
ENV = dict(HOST_ENV, GLOO_SOCKET_IFNAME=IFNAME)  # gloo would take the hostname's address (127.0.0.1)
T = TypeVar("T")


class Job:
    """One training job: torchrun agents on the nodes of ``cluster``, rendezvousing at node 0."""

    def __init__(self, cluster: Cluster, base: Path, on_line: Callable[[str], None] | None = None,
                 script: list[str] | None = None) -> None:
        self.cluster, self.base, self.on_line = cluster, base, on_line
        self.script = script or [SCRIPT, *args(base)]  # the workers' script and its arguments
        self.agents: list[tuple[int, Proc]] = []  # (node, agent) in the order started
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line arrived (time.monotonic())

    def start(self, node: int, *extra: str, nnodes: str = "2", restarts: int = 0,
              env: dict[str, str] | None = None) -> Proc:
        """Start an agent on node ``node``; ``extra`` goes to this node's workers only."""
        host, here = self.cluster.nodes[0], self.cluster.nodes[node]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={host.addr}:{PORT}", f"--rdzv-id={self.base.name}",
               f"--rdzv-conf=is_host={int(node == 0)},{RDZV}", f"--local-addr={here.addr}",
               f"--max-restarts={restarts}", *self.script, *extra]

        def on_line(line: str) -> None:
            self.times.append(time.monotonic())
            self.lines.append(f"node{node}| {line}")
            if self.on_line is not None:
                self.on_line(line)

        agent = here.start(cmd, env or ENV, on_line)
        self.agents.append((node, agent))
        return agent

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def first(self, text: str, after: float = 0.0) -> float:
        """When the first line containing ``text`` arrived after ``after`` (time.monotonic())."""
        # strict=False: the reader thread may append a line between the two copies
        return next(t for t, line in zip(list(self.times), list(self.lines), strict=False)
                    if t >= after and text in line)

    def until(self, what: str, found: Callable[[], T]) -> T:
        """Poll ``found()`` until it is true; past the deadline, end every process and fail."""
        deadline = time.monotonic() + DEADLINE
        while not (value := found()):
            if time.monotonic() > deadline:
                self.cluster.kill_all()
                pytest.fail(f"{what}: not within {DEADLINE:.0f} s\n{self.out}")
            time.sleep(0.05)
        return value

    def wait(self) -> list[int]:
        """The exit status of every agent, in the order started (each must end by the deadline)."""
        codes = []
        for node, agent in self.agents:
            code = agent.wait(DEADLINE)
            if code is None:
                self.cluster.kill_all()
                pytest.fail(f"the agent on node {node} did not end within {DEADLINE:.0f} s\n{self.out}")
            codes.append(code)
        return codes


def args(base: Path) -> list[str]:
    return ["--run-dir", str(base / "run"), "--out", str(base / "out"), "--mode", "ddp", "--steps", str(STEPS),
            "--save-every", str(SAVE_EVERY), "--global-batch", str(GLOBAL_BATCH)]


def committed(base: Path) -> list[int]:
    return [int(name.split("-")[1]) for name in open_store(base / "run").list_committed()]


def check_bitwise(reference: Path, base: Path) -> None:
    """Final parameters and optimizer state, every rank's loss and samples at every step."""
    assert same_final(reference, base / "out")
    for rank in (0, 1):
        assert losses(base / "out", rank) == losses(reference, rank)


def relaunch_and_check(cluster: Cluster, reference: Path, base: Path, step: int) -> None:
    """The job launched again on both nodes resumes from ``step`` on both ranks and ends bitwise."""
    again = Job(cluster, base)
    again.start(1)
    again.start(0)
    assert again.wait() == [0, 0], again.out
    assert all(f"rank {r}: resumed from step {step}" in again.out for r in (0, 1)), again.out
    assert open_store(base / "run").list_uncommitted() == []  # whatever a lost node left is gone
    check_bitwise(reference, base)


def pending(pid: int, sig: int) -> bool:
    """True if ``sig`` was sent to process ``pid`` and waits to be handled (the process is stopped)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def need_netns() -> None:
    """Skip (fail with ``UNBROKEN_REQUIRE_NETNS=1``) where network namespaces cannot be made."""
    reason = available()
    if reason is not None:
        if os.environ.get("UNBROKEN_REQUIRE_NETNS"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two nodes for the whole module; torn down (processes, links, namespaces) whatever happens."""
    need_netns()
    with Cluster(2) as made:
        yield made


@pytest.fixture()
def nodes(cluster: Cluster) -> Iterator[Cluster]:
    """The module's cluster, with no process left on it after the test (passed or failed)."""
    yield cluster
    cluster.kill_all()


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job on both nodes."""
    base = tmp_path_factory.mktemp("reference")
    job = Job(cluster, base)
    job.start(1)
    job.start(0)
    assert job.wait() == [0, 0], job.out
    return base / "out"


# --------------------------------------------------------------------------- the harness itself
PROBE = """
import socket, sys
s = socket.socket()
try:
    s.settimeout(5)
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as e:
    print("refused" if isinstance(e, ConnectionRefusedError) else f"failed: {e}")
"""
LISTEN = """
import socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("listening", flush=True)
time.sleep(3600)
"""


def test_nodes_reach_each_other_only_by_address_and_are_torn_down_when_a_test_fails() -> None:
    """A node reaches another's address over the bridge, not its loopback (each node has its own);
    leaving the ``with`` by an exception kills every process on every node and removes the links and
    the namespaces."""
    need_netns()
    listening: list[str] = []
    with pytest.raises(RuntimeError, match="the test failed"), Cluster(2) as made:
        node0, node1 = made.nodes
        for addr, port in ((node0.addr, PORT), ("127.0.0.1", PORT + 1)):
            node0.start([sys.executable, "-c", LISTEN, addr, str(port)], HOST_ENV, listening.append)
        deadline = time.monotonic() + 60
        while len(listening) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(listening) == 2
        for addr, port, answer in ((node0.addr, PORT, "connected"), ("127.0.0.1", PORT + 1, "refused")):
            probe = node1.start([sys.executable, "-c", PROBE, addr, str(port)], HOST_ENV)
            assert probe.wait(60) == 0 and probe.output == answer + "\n", (addr, probe.output)
        listeners = node0.pids()
        assert len(listeners) == 2
        raise RuntimeError("the test failed")
    assert all(ended(pid) for pid in listeners)
    assert not {n.name for n in made.nodes} & set(namespaces()) and made.bridge not in links()


def test_namespaces_of_a_killed_session_are_collected_at_the_next_start(tmp_path: Path) -> None:
    """A session SIGKILLed with its cluster up (no teardown could run) leaves namespaces, links and
    processes; the next ``Cluster()`` of any process removes them (their owner is dead)."""
    need_netns()
    left = tmp_path / "left"
    code = f"""
import os, signal, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from netns import Cluster
c = Cluster(2)
p = c.nodes[1].start([sys.executable, "-c", "import time; time.sleep(3600)"], dict(os.environ))
time.sleep(0.5)
open({str(left)!r}, "w").write(" ".join([*(n.name for n in c.nodes), c.bridge, str(p.popen.pid)]))
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code], env=HOST_ENV, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    *stale, bridge, sleeper = left.read_text().split()
    assert set(stale) <= set(namespaces()) and bridge in links()
    assert not ended(int(sleeper))
    with Cluster(1):  # collects first
        assert not set(stale) & set(namespaces()) and bridge not in links()
    assert ended(int(sleeper))


# ---------------------------------------------------------------------------- node losses
def test_nodes_lost_inside_saves_and_at_a_step_each_relaunch_resumes_and_the_job_ends_bitwise(
        nodes: Cluster, reference: Path, tmp_path: Path) -> None:
    """Three node losses in one job, each followed by a relaunch on both nodes; every process of the
    lost node is SIGKILLed at once:

    1. node 0 (rank 0: the run's writer, the rendezvous and the workers' store) inside the save of
       step 8, after every rank wrote its files, before the manifest;
    2. node 1 inside the save of step 12, half-way through one of its tensor files;
    3. node 0 after step 14, no save under way.

    In a save the lost node's worker freezes at the fault point first, so the loss happens there. A
    save a node was lost in is never committed and the next launch removes what it staged; the agent
    on the other node ends by itself; every relaunch resumes from the newest committed step on both
    ranks. In the last launch only node 1's worker is SIGKILLed after step 14, its node intact: both
    agents restart their workers (``--max-restarts``) in the store node 0's agent kept from the
    first round (each node counting restarts its own way), which resume from step 12 again. The job
    ends bitwise equal to the uninterrupted one."""
    def faulty(fault: str) -> dict[str, str]:
        return dict(ENV, UNBROKEN_FAULTS=fault, UNBROKEN_FAULT_ACTION="stop")

    losses_ = [  # (lost node, its environment, its extra arguments, steps committed after the loss)
        (0, faulty("save.before_manifest=2"), (), [4]),   # its 2nd save: step 8
        (1, faulty("save.mid_file=3"), (), [4, 8]),       # 2 tensor files a save: step 12 (from 4)
        (0, ENV, ("--stop-after", "14"), [4, 8, 12]),
    ]
    resumed = 0
    for lost, env, extra, after in losses_:
        job = Job(nodes, tmp_path)
        job.start(1, *(extra if lost == 1 else ()), env=env if lost == 1 else ENV)
        job.start(0, *(extra if lost == 0 else ()), env=env if lost == 0 else ENV)
        job.until(f"node {lost}'s worker frozen", nodes.nodes[lost].stopped)
        if not extra:
            assert open_store(tmp_path / "run").list_uncommitted(), "a save is under way"
        nodes.nodes[lost].kill_all()
        by_node = dict(zip((1, 0), job.wait(), strict=True))
        assert by_node[lost] == -signal.SIGKILL and by_node[1 - lost] != 0, job.out
        assert nodes.nodes[1 - lost].pids() == [], job.out  # the other node's worker ended too
        if resumed:
            assert all(f"rank {r}: resumed from step {resumed}" in job.out for r in (0, 1)), job.out
        assert committed(tmp_path) == after, job.out
        resumed = after[-1]
    job = Job(nodes, tmp_path)
    job.start(1, "--stop-after", "14", restarts=1)
    job.start(0, restarts=1)
    (worker,) = job.until("rank 1 stopped after step 14", nodes.nodes[1].stopped)
    os.kill(worker, signal.SIGKILL)
    assert job.wait() == [0, 0], job.out
    assert all(job.out.count(f"rank {r}: resumed from step {resumed}") == 2 for r in (0, 1)), job.out
    assert open_store(tmp_path / "run").list_uncommitted() == []
    check_bitwise(reference, tmp_path)


def test_ram_tier_a_lost_node_resumes_from_the_other_nodes_memory_and_the_job_ends_bitwise(
        nodes: Cluster, reference: Path, tmp_path: Path) -> None:
    """The RAM tier on two nodes, each with its own memory (a RAM root per node, as each machine has
    its own /dev/shm): a save every step, in memory only (persisted every 50: never before the end).
    Node 1 is lost after step 10 (every process SIGKILLed, its memory wiped: a replacement node),
    then, in the relaunch, node 0 after step 13. Each relaunch resumes from the lost step on both
    ranks, read from the surviving node's memory and copied to the new node first; the job ends
    bitwise equal to the uninterrupted one."""
    ram = ("--save-every", "1", "--ram", "50")

    def env(node: int) -> dict[str, str]:
        return dict(ENV, UNBROKEN_RAM_ROOT=str(tmp_path / f"shm{node}"))

    resumed = 0
    for lost, step in ((1, 10), (0, 13)):
        job = Job(nodes, tmp_path)
        job.start(1, *ram, *(("--stop-after", str(step)) if lost == 1 else ()), env=env(1))
        job.start(0, *ram, *(("--stop-after", str(step)) if lost == 0 else ()), env=env(0))
        job.until(f"node {lost}'s worker stopped after step {step}", nodes.nodes[lost].stopped)
        nodes.nodes[lost].kill_all()
        shutil.rmtree(tmp_path / f"shm{lost}")
        by_node = dict(zip((1, 0), job.wait(), strict=True))
        assert by_node[lost] == -signal.SIGKILL and by_node[1 - lost] != 0, job.out
        if resumed:
            assert all(f"rank {r}: resumed from step {resumed}" in job.out for r in (0, 1)), job.out
            assert f"copied RAM checkpoint step-{resumed:09d} from node 0's memory to node(s) 1" in job.out
        resumed = step
    job = Job(nodes, tmp_path)
    job.start(1, *ram, env=env(1))
    job.start(0, *ram, env=env(0))
    assert job.wait() == [0, 0], job.out
    assert all(f"rank {r}: resumed from step 13" in job.out for r in (0, 1)), job.out
    assert "copied RAM checkpoint step-000000013 from node 1's memory to node(s) 0" in job.out
    # on disk: step 10, persisted by node 0's worker as it ended (a crash persists the newest), and the
    # last; never step 13 (its node was lost), which the relaunch read from node 1's memory
    assert committed(tmp_path) == [10, STEPS]
    assert [p for node in (0, 1) for p in (tmp_path / f"shm{node}").rglob("*")] == []
    check_bitwise(reference, tmp_path)


# ------------------------------------------------------------------------------ warm restarts
def test_warm_spares_on_each_node_a_killed_rank_restarts_both_nodes_warm_and_the_job_ends_bitwise(
        nodes: Cluster, reference: Path, tmp_path: Path) -> None:
    """``torchrun --nnodes 2 ... -m unbroken.launch.worker``: each node's agent has a spare server of its own,
    started inside the node (its namespace). Rank 1's training is SIGKILLed after step 10, once both nodes have
    a spare ready; both agents restart their workers (``--max-restarts``), each from a spare of its own node
    (four warm starts: two nodes, two rounds; no cold one), both ranks resume from step 8 and the job ends
    bitwise equal to the uninterrupted one (which ran cold)."""
    from unbroken.launch.worker import status

    spares = tmp_path / "spares"  # one folder for both nodes, as a shared home would be: a server each
    # plain interpreters (not the fork server's children, tests/zygote.py): a worker finds its node's spares by
    # its parent, torchrun's agent, which a forked worker does not have (its parent is the fork server)
    env = dict(ENV, UNBROKEN_SPARES_DIR=str(spares), UNBROKEN_SPARES_IDLE_S="30", UNBROKEN_TEST_PLAIN="1")
    job = Job(nodes, tmp_path, script=["-m", "unbroken.launch.worker", SCRIPT, *args(tmp_path)])
    job.start(1, "--stop-after", "10", restarts=1, env=env)
    job.start(0, restarts=1, env=env)
    (training,) = job.until("rank 1 stopped after step 10", nodes.nodes[1].stopped)

    def both_ready() -> bool:
        found = [status(str(f)) for f in spares.iterdir()] if spares.is_dir() else []
        return len(found) == 2 and all(s is not None and s["ready"] >= 1 for s in found)

    job.until("a spare ready on each node", both_ready)
    os.kill(training, signal.SIGKILL)
    assert job.wait() == [0, 0], job.out
    assert job.out.count("warm start: the spare") == 4 and "cold start" not in job.out, job.out
    assert all(job.out.count(f"rank {r}: resumed from step 8") == 1 for r in (0, 1)), job.out
    check_bitwise(reference, tmp_path)


# ------------------------------------------------------------------------------- SIGTERM
def test_sigterm_to_every_process_on_every_node_is_one_preemption_and_no_step_is_lost(
        nodes: Cluster, reference: Path, tmp_path: Path) -> None:
    """As SLURM preempts a job: SIGTERM to every process on every node at once, both agents and both
    workers (each agent forwards its copy to its worker milliseconds later). Every rank saves the
    same step, the last one each finished, and exits 75; the agents end; the relaunch resumes there."""
    sent: list[int] = []

    def on_line(line: str) -> None:
        if not sent and "rank 1 step 6" in line:
            sent.extend(nodes.signal_all(signal.SIGTERM))

    job = Job(nodes, tmp_path, on_line)
    job.start(1)
    job.start(0)
    codes = job.wait()
    assert len(sent) == 4, (sent, job.out)  # two agents, two workers
    assert all(code != 0 for code in codes), job.out
    ended = [(tmp_path / "out" / f"exit-r{r}").read_text() for r in (0, 1)]
    assert ended == [str(EXIT_PREEMPTED)] * 2, job.out
    preempted = re.findall(r"^node\d\| preempted at step (\d+)$", job.out, re.M)
    assert len(preempted) == 2 and len(set(preempted)) == 1, job.out  # one preemption, the same step
    step = int(preempted[0])
    assert step >= 6 and all(max(losses(tmp_path / "out", r)) == step for r in (0, 1)), job.out  # none lost
    assert committed(tmp_path)[-1] == step
    relaunch_and_check(nodes, reference, tmp_path, step)


def test_elastic_job_shrinks_to_the_surviving_node_and_grows_back_at_the_same_global_sample(
        nodes: Cluster, reference: Path, tmp_path: Path) -> None:
    """``--nnodes 1:2``: node 1 is lost after step 6; node 0's agent restarts its worker at world size
    1, which resumes from step 4 at global sample 64 (the global batch kept: 16 samples a step on one
    rank). After step 11 a new node 1 joins: node 0's agent stops its worker (SIGTERM: it saves step
    12 and exits 75, no step lost) and the job continues on both nodes from global sample 192.

    Every step's global samples are the uninterrupted run's. At another world size the training is
    not bitwise the uninterrupted run's (docs/distributed.md), but it is reproducible: the elastic
    job ends bitwise equal (final state, every loss) to a planned one that runs steps 5-12 on one
    process and 13-16 on two, started from the same checkpoint of step 4."""
    # torch 2.13: with the agent's TCP store shared with the workers (the default), a node joining
    # a later round waits for a MASTER_ADDR that rank 0's agent publishes only in its first round
    # (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1209): the job cannot grow back
    # plain interpreters (tests/zygote.py): node 0's agent signals its worker while that worker is stopped, and
    # a fork server's launcher, stopped with the worker it stands for, could not pass the signal on
    env = dict(ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", UNBROKEN_TEST_PLAIN="1")
    planned = tmp_path / "planned"
    job = Job(nodes, tmp_path)
    elastic = {"nnodes": "1:2", "restarts": 3, "env": env}
    job.start(1, "--stop-after", "6@2", **elastic)  # node 1 first: the first round has both nodes
    job.start(0, "--stop-after", "11@1", **elastic)
    job.until("rank 1 stopped after step 6", nodes.nodes[1].stopped)
    assert committed(tmp_path) == [SAVE_EVERY]
    shutil.copytree(tmp_path / "run" / f"step-{SAVE_EVERY:09d}", planned / "run" / f"step-{SAVE_EVERY:09d}")
    nodes.nodes[1].kill_all()
    lost = time.monotonic()
    (held,) = job.until("the job, shrunk to node 0, held after step 11", nodes.nodes[0].stopped)
    joined = time.monotonic()
    job.start(1, **elastic)  # a new node 1
    job.until("node 0's agent stopping its worker for the new node", lambda: pending(held, signal.SIGTERM))
    os.kill(held, signal.SIGCONT)
    codes = job.wait()
    assert codes == [-signal.SIGKILL, 0, 0], job.out
    out = job.out
    assert "world size changed from 2 to 1" in out and "the data continues at global sample 64 of epoch 0" in out
    assert "node0| rank 0: resumed from step 4" in out and "node0| preempted at step 12" in out, out
    assert "world size changed from 1 to 2" in out and "the data continues at global sample 192 of epoch 0" in out
    assert all(f"rank {r}: resumed from step 12" in out for r in (0, 1)), out
    print(f"elastic: trained again at world size 1 {job.first('step 5', lost) - lost:.1f} s after node 1 was "
          f"lost, at 2 {job.first('step 13', joined) - joined:.1f} s after the new node's agent started")

    ref = [losses(reference, r) for r in (0, 1)]
    got = [losses(tmp_path / "out", r) for r in (0, 1)]
    for step in range(1, STEPS + 1):  # the global samples of every step: one rank on steps 5-12
        ranks = (0,) if SAVE_EVERY < step <= 12 else (0, 1)
        assert sorted(i for r in ranks for i in got[r][step][1]) == sorted(i for r in (0, 1) for i in ref[r][step][1])
    for rank, last in ((0, SAVE_EVERY), (1, 6)):  # before the shrink: the uninterrupted run, bitwise
        assert all(got[rank][s] == ref[rank][s] for s in range(1, last + 1))  # (rank 0 redid 5-6 on its own)

    host = [sys.executable, "-m", "torch.distributed.run", "--standalone", SCRIPT, *args(planned)]
    code, log = run([*host[:4], "--nproc-per-node=1", *host[4:], "--stop-at", "12"], env=HOST_ENV)
    assert code == 0 and "resumed from step 4" in log, log
    code, log = run([*host[:4], "--nproc-per-node=2", *host[4:]], env=HOST_ENV)
    assert code == 0 and "resumed from step 12" in log, log
    assert same_final(planned / "out", tmp_path / "out")
    want = [losses(planned / "out", r) for r in (0, 1)]
    assert {s: got[0][s] for s in range(5, STEPS + 1)} == want[0]
    assert {s: got[1][s] for s in range(13, STEPS + 1)} == want[1]
