"""A real one-node SLURM cluster in a temporary directory, for the integration tests.

Everything is private to the cluster: its own munge key and munged (on its own
socket, ``AuthInfo=socket=...``), its own ports, state, spool, pid and log files, all
under one temp dir. Nothing in ``/etc`` is read or changed, and a system SLURM on the
same machine is left alone. The client commands find the cluster through
``SLURM_CONF`` (see :attr:`SlurmCluster.env`).

    cluster = SlurmCluster()
    cluster.start()              # munged, slurmctld -D, slurmd -D; waits for the node to be idle
    subprocess.run(["sbatch", ...], env=cluster.env)
    cluster.stop()               # scancel, SIGTERM, SIGKILL after 3 s, remove the dir

The daemons run in the foreground (``-D``) as children of this process, so their
pids are known and only they (and the job processes they started, found by the
cluster's ``SLURM_CONF`` in their environment) are ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from ports import free_port
from procs import with_environment

REPO = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO / "scripts" / "install_system_deps.sh"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

T = TypeVar("T")
PREFIX = "unbroken-slurm-"

CRED_EXPIRE = 10
"""Job credential lifetime (default 120 s). It is also how long slurmctld holds back a
requeued job (its BeginTime is set to requeue time + CRED_EXPIRE + 1): slurmd refuses
to launch a job whose credential is not newer than the one it revoked when the job
was killed ("Job credential revoked"; the job then FAILS). So the tests let that
delay pass rather than force a restart with ``scontrol update StartTime=now``, which
fails that way when the relaunch falls in the same second as the revocation."""


class ClusterError(RuntimeError):
    """The cluster could not be started or did not behave; the message has the daemon logs."""


def missing_programs() -> list[str]:
    """The SLURM/munge programs not found on PATH (also looks in /usr/sbin, /sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
    return [p for p in (*DAEMONS, *CLIENTS, "munge") if shutil.which(p, path=path) is None]


def ensure_installed() -> str | None:
    """Make sure SLURM and munge are installed; None if they are, else why they cannot be.

    If something is missing, runs ``scripts/install_system_deps.sh`` (which installs
    ``slurm-wlm`` and ``munge`` with apt-get when root, and is a no-op otherwise).
    """
    missing = missing_programs()
    if not missing:
        return None
    out = ""
    if os.geteuid() == 0 and shutil.which("apt-get"):
        proc = subprocess.run(["sh", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=600)
        out = (proc.stdout + proc.stderr).strip()
        missing = missing_programs()
        if not missing:
            return None
    why = "not root" if os.geteuid() != 0 else "apt-get not available" if not shutil.which("apt-get") \
        else "apt-get install failed"
    return (f"SLURM not installed ({', '.join(missing)} missing) and cannot be installed ({why}); "
            f"run scripts/install_system_deps.sh as root" + (f"\n{out[-2000:]}" if out else ""))


def slurm_version() -> tuple[int, int]:
    """(major, minor) of the installed slurmd, e.g. (22, 5) for 22.05.8."""
    out = subprocess.run([_which("slurmd"), "-V"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m:
        raise ClusterError(f"cannot parse `slurmd -V` output: {out!r}")
    return int(m.group(1)), int(m.group(2))


def _which(prog: str) -> str:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
    found = shutil.which(prog, path=path)
    if found is None:
        raise ClusterError(f"{prog} not found")
    return found


def _die_with_parent() -> None:
    """In the daemon before exec: SIGTERM it when this process dies (pytest killed by a timeout
    or a cancelled CI job never runs the fixture's teardown; the daemons must not outlive it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    return free_port()  # below the ephemeral range (:mod:`ports`)


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"({e})"
    return "\n".join(text[-lines:])


def parse_fields(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of ``scontrol show ... -o`` output (values without spaces)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _kill_processes_of(conf: Path) -> None:
    """SIGKILL every process whose environment has SLURM_CONF=conf: the daemons, slurmstepds and
    job processes of that cluster (the daemons are started with it, and everything below inherits it)."""
    for pid in with_environment("SLURM_CONF", str(conf)):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def clean_stale(base: str | os.PathLike[str] | None = None) -> None:
    """Remove clusters left behind by a test process that was killed before its teardown.

    The daemons die with that process (PR_SET_PDEATHSIG), but a running job's slurmstepd
    and processes do not; they are found by their SLURM_CONF and killed here.
    """
    for d in Path(base or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            owner = int((d / "owner.pid").read_text())
            if d.owner() != getpass.getuser():
                continue
        except (OSError, ValueError, KeyError):
            continue
        if Path("/proc", str(owner)).exists():
            continue  # still running (another test session)
        _kill_processes_of(d / "slurm.conf")
        shutil.rmtree(d, ignore_errors=True)


class SlurmCluster:
    """One controller and one compute node (this machine), all under ``self.dir``."""

    def __init__(self, base: str | os.PathLike[str] | None = None, keep: bool | None = None) -> None:
        # munged requires every directory above its socket to be searchable by all, which
        # pytest's tmp_path (under a 0700 /tmp/pytest-of-USER) is not: use a fresh dir in /tmp.
        clean_stale(base)
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
        self.dir.chmod(0o755)
        (self.dir / "owner.pid").write_text(str(os.getpid()))
        self.keep = bool(os.environ.get("UNBROKEN_SLURM_KEEP")) if keep is None else keep
        self.conf = self.dir / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self.user = getpass.getuser()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_",
                                                                             "SALLOC_", "SQUEUE_"))}
        self.env["SLURM_CONF"] = str(self.conf)
        self.started = False

    # --- paths -------------------------------------------------------------------------
    @property
    def munge_socket(self) -> Path:
        return self.dir / "run" / "munge.socket"

    def log_files(self) -> list[Path]:
        return sorted((self.dir / "log").glob("*"))

    # --- start / stop ------------------------------------------------------------------
    def write_config(self) -> None:
        d = self.dir
        for sub in ("run", "state", "spool", "log"):
            (d / sub).mkdir(exist_ok=True)
            (d / sub).chmod(0o755)
        (d / "munge").mkdir(mode=0o700, exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        cpus = len(os.sched_getaffinity(0))
        mem = max(100, int(_memory_mb() * 0.8))
        ctld_port, slurmd_port = _free_port(), _free_port()
        self.conf.write_text(f"""\
# one-node test cluster written by tests/slurm_cluster.py
ClusterName=unbroken-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={self.user}
SlurmdUser={self.user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        if slurm_version() >= (24, 5):  # CgroupPlugin=disabled exists from 24.05; 22.05 needs no cgroup.conf
            (d / "cgroup.conf").write_text("CgroupPlugin=disabled\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / "log" / f"{name}.stdout", "wb")
        try:
            self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                                stderr=subprocess.STDOUT, env=self.env, cwd=self.dir,
                                                start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            out.close()

    def _check_alive(self, files: tuple[Path, ...] = ()) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise ClusterError(f"{name} exited unexpectedly with status {p.returncode}\n"
                                   + self.diagnostics(*files))

    def wait(self, fn: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2,
             check_daemons: bool = True, files: tuple[Path, ...] = ()) -> T:
        """Poll ``fn`` until it returns a truthy value.

        ClusterError after ``timeout`` (or as soon as a daemon dies), with the tails of
        ``files`` (e.g. the job's output) and of the daemon logs in the message.
        """
        deadline = time.monotonic() + timeout
        while True:
            value = fn()
            if value:
                return value
            if check_daemons:
                self._check_alive(files)
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                   + self.diagnostics(*files))
            time.sleep(interval)

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        """Start munged, slurmctld and slurmd; return once the node is idle."""
        try:
            self.write_config()
            d = self.dir
            self._spawn("munged", [_which("munged"), "--foreground", f"--socket={self.munge_socket}",
                                   f"--key-file={d}/munge/munge.key", f"--pid-file={d}/run/munged.pid",
                                   f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge/munged.seed"])
            self.wait(lambda: self.munge_socket.exists(), 10, "munged's socket")
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
            self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
            self.started = True
            self.wait(lambda: self.node_state() == "idle", timeout, f"node {self.node} to be idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel the jobs, SIGTERM the daemons (SIGKILL after 3 s), remove the directory."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                subprocess.run([_which("scancel"), "--user", self.user], env=self.env, timeout=10,
                               capture_output=True)
                self.wait(lambda: not self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip(),
                          10, "the jobs to end", check_daemons=False)
            except (ClusterError, subprocess.SubprocessError, OSError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):  # munged last: the others talk to it to the end
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._kill_leftovers()
        self.procs.clear()
        self.started = False
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        _kill_processes_of(self.conf)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- client commands ---------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster."""
        proc = subprocess.run([_which(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}\n"
                               + self.diagnostics())
        return proc

    def node_state(self) -> str:
        proc = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False, timeout=10)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def sbatch(self, *argv: str) -> str:
        """Submit a job; return its id."""
        return self.run("sbatch", "--parsable", *argv).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` fields (JobState, Reason, Restarts, ExitCode, ...); {} if unknown."""
        proc = self.run("scontrol", "-o", "show", "job", job_id, check=False, timeout=10)
        return parse_fields(proc.stdout) if proc.returncode == 0 else {}

    def job_state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    # --- diagnostics -------------------------------------------------------------------
    def diagnostics(self, *extra: Path, lines: int = 60) -> str:
        """The tails of the given files (job output) and of every daemon log, for failure messages."""
        parts = []
        logs = [p for p in self.log_files()  # -D also copies the log to stderr: show the .stdout only
                if not (p.suffix == ".stdout" and p.with_suffix(".log").exists())]  # if it has no .log
        for path in (*extra, *logs):
            parts.append(f"----- {path} (last {lines} lines) -----\n{_tail(path, lines)}")
        parts.append("----- processes -----\n" + ", ".join(
            f"{n}: {'running' if p.poll() is None else f'exited {p.returncode}'}" for n, p in self.procs.items()))
        return "\n".join(parts)
