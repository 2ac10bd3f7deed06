"""Several "nodes" on one machine: Linux network namespaces on a private bridge, for the multi-node tests.

Each node is a network namespace with its own loopback and one interface (``eth0``) on a bridge
private to the cluster, with a private address (``10.a.b.1``, ``10.a.b.2``, ...). A process started
on a node (``ip netns exec``) sees only that node's network: what it exchanges with another node
goes over the bridge, to the other node's address. The filesystem is shared by every node (the
test's ``tmp_path`` is the cluster's shared filesystem), and so is the process table, which lets a
test find and signal every process of a node (``ip netns pids``).

    with Cluster(2) as cluster:             # needs root and iproute2 (``available()`` says why not)
        node0, node1 = cluster.nodes
        job = node0.start([sys.executable, "-m", "torch.distributed.run", ...], env)
        node1.kill_all()                    # the node is lost: every process of it SIGKILLed at once
        cluster.signal_all(signal.SIGTERM)  # a scheduler's preemption: every process on every node

Names carry the owner's pid (``ubn<pid>x<k>...``), so parallel test workers never collide. Teardown
(``close()``) always runs: on leaving the ``with``, at interpreter exit (``atexit``) if the owner
never got there, and for a session that was killed outright, at the next ``Cluster()`` of any
process, which removes the namespaces and links of owners that are no longer alive.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

IP = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])) or "ip"
IFNAME = "eth0"
"""The interface of every node, inside its namespace (``GLOO_SOCKET_IFNAME=eth0`` on a node)."""

_OURS = re.compile(r"^ubn(\d+)x(\d+)")  # namespaces ubn<pid>x<k>n<i>, bridge ubn<pid>x<k>b, links ubn<pid>x<k>v<i>
_made = itertools.count()
_open: set[Cluster] = set()


class NetnsError(RuntimeError):
    """A namespace, link or address could not be set up; the message has ``ip``'s answer."""


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@functools.cache
def available() -> str | None:
    """None if this process can create namespaces, else why not (for a skip reason)."""
    if not shutil.which(IP):
        return "iproute2 (ip) is not installed: run scripts/install_system_deps.sh as root"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    name = f"ubn{os.getpid()}xprobe"
    try:
        _ip("netns", "add", name)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    _ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect_stale() -> list[str]:
    """Remove the namespaces and links left by owners that are no longer alive (a killed session);
    the names removed."""
    removed = []
    for name in namespaces():
        m = _OURS.match(name)
        if m and not _alive(int(m.group(1))):
            _kill_namespace(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for link in links():
        m = _OURS.match(link)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


def namespaces() -> list[str]:
    """The names of the network namespaces of this machine (``ip netns list``)."""
    return [line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line.strip()]


def links() -> list[str]:
    """The names of the network links of this process's namespace (``ip link show``)."""
    return [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show", check=False).splitlines()
            if line.count(":") >= 2]


def ended(pid: int) -> bool:
    """True if process ``pid`` has ended (it may wait to be reaped: a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:].startswith(b"Z")


def _pids(namespace: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", namespace, check=False).split()]


STAND_IN = b"zygote-launch\n"
"""``/proc/PID/comm`` of a launcher of the tests' fork server (tests/zygote.py), which stands for a process it
had forked into the node (the child joins the node's namespaces): the child is the node's process."""


def _stand_in(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes() == STAND_IN
    except OSError:
        return False


def _kill_namespace(namespace: str, rounds: int = 50) -> None:
    """SIGKILL every process of ``namespace`` until none is left (a process may be forking)."""
    for _ in range(rounds):
        pids = _pids(namespace)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


class Proc:
    """A process started on a node; its output (stdout and stderr) is read line by line by a thread."""

    def __init__(self, popen: subprocess.Popen, on_line: Callable[[str], None] | None) -> None:
        self.popen = popen
        self.lines: list[str] = []
        self._on_line = on_line
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self.popen.stdout:  # type: ignore[union-attr]
            for line in self.popen.stdout:  # type: ignore[union-attr]
                self.lines.append(line)
                if self._on_line is not None:
                    self._on_line(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it is still running after ``timeout`` seconds. Its output is
        complete once this returns a status (the readers' pipe is closed by every process that had it)."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout)
        return code


class Node:
    """One namespace of a :class:`Cluster`: ``name``, its address ``addr`` on the cluster network."""

    def __init__(self, name: str, addr: str) -> None:
        self.name, self.addr = name, addr
        self.procs: list[Proc] = []

    def start(self, cmd: Sequence[str], env: dict[str, str], on_line: Callable[[str], None] | None = None,
              cwd: str | Path | None = None) -> Proc:
        """Run ``cmd`` on this node (in its own session: a test's process group is never signalled)."""
        popen = subprocess.Popen([IP, "netns", "exec", self.name, *cmd], env=env, cwd=cwd, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(Proc(popen, on_line))
        return self.procs[-1]

    def pids(self) -> list[int]:
        """Every process running on this node (a fork server's launcher aside: the process it stands for is
        listed, and a signal sent to both would reach that process twice)."""
        return [pid for pid in _pids(self.name) if not _stand_in(pid)]

    def stopped(self) -> list[int]:
        """The processes on this node that are stopped (SIGSTOP: state T in /proc)."""
        found = []
        for pid in self.pids():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{pid}/stat").read_bytes()
                if stat[stat.rfind(b")") + 2:].startswith(b"T"):
                    found.append(pid)
        return found

    def kill_all(self) -> list[int]:
        """The node is lost: SIGKILL every process on it at once (again until none is left); the pids
        of the first round."""
        first = self.pids()
        for pid in first:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _kill_namespace(self.name)
        for proc in self.procs:  # reap the ones started here (the others' parent was one of them)
            proc.wait(10)
        return first


class Cluster:
    """``n`` nodes on a private bridge; a context manager that always tears everything down."""

    def __init__(self, n: int) -> None:
        collect_stale()
        k = next(_made)
        self._tag = f"ubn{os.getpid()}x{k}"
        if len(self._tag) > 13 or n > 10:  # link names: the tag, "b" or "v<i>", 15 characters at most
            raise NetnsError(f"cluster {k} of {n} nodes: too many for the names of the links")
        subnet = f"10.{200 + (os.getpid() >> 8) % 50}.{(os.getpid() + k) % 256}"  # private; no host route
        self.bridge = f"{self._tag}b"
        self.nodes = [Node(f"{self._tag}n{i}", f"{subnet}.{i + 1}") for i in range(n)]
        self._closed = False
        _open.add(self)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, node in enumerate(self.nodes):
                veth = f"{self._tag}v{i}"
                _ip("netns", "add", node.name)
                _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", node.name)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", node.name, "addr", "add", f"{node.addr}/24", "dev", IFNAME)
                _ip("-n", node.name, "link", "set", IFNAME, "up")
                _ip("-n", node.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def signal_all(self, sig: int) -> list[int]:
        """Send ``sig`` to every process on every node at once (listed first, then signalled in one
        pass, as a scheduler does); the pids signalled."""
        pids = [pid for node in self.nodes for pid in node.pids()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def kill_all(self) -> None:
        """SIGKILL every process on every node (the nodes stay)."""
        for node in self.nodes:
            node.kill_all()

    def close(self) -> None:
        """Kill every process on every node, delete the links, the bridge and the namespaces
        (idempotent; errors of one step do not stop the next)."""
        if self._closed:
            return
        self._closed = True
        for i, node in enumerate(self.nodes):
            node.kill_all()
            _ip("link", "del", f"{self._tag}v{i}", check=False)  # and its peer inside the namespace
            _ip("netns", "del", node.name, check=False)
        _ip("link", "del", self.bridge, check=False)
        _open.discard(self)


@atexit.register
def _close_all() -> None:
    for cluster in list(_open):
        cluster.close()
