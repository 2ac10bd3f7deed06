"""A fork server for the Python processes the tests launch: ``import torch`` paid once per worker.

Most of the suite's CPU is the start of the processes it launches: ``import torch`` costs 2.5-3.5 s of
CPU on this machine, ``import transformers.trainer`` or ``lightning.pytorch`` 7-8 s, and a 60-step run
of the demo 6-7 s in all. The zygote (:mod:`zygote_server`) is a Python process that has imported
torch and what the jobs import of it as a matter of course (``zygote_server.PRELOAD``), numpy, and
unbroken's training side and CLI (a job that puts another unbroken on its path starts plainly), never ran an operator
(no thread pool to break a fork), and forks a child for each launch. The test files of ``ZYGOTE_MODULES``
(``conftest.py``) see ``sys.executable`` replaced by a launcher, ``<dir>/bin/python``; the virtual
environment's console scripts (``unbroken``, ``torchrun``) are copied beside it with the launcher as their
interpreter, its other entries linked.

The launcher (this module) is a small Python started with ``-S -I`` (about 20 ms). It sends the
zygote what makes a process what it is: the command line, environment, working folder, umask,
resource limits, CPU affinity, nice value, ignored signals and signal mask, and every open descriptor
(passed with ``SCM_RIGHTS``: standard streams and the pipes of ``pass_fds`` arrive under the same
numbers). The zygote forks; the child takes all of it, starts a session of its own, reseeds what a
fresh process seeds (torch's default generator, numpy's global one; Python's ``random`` does it
itself), sets the threads ``OMP_NUM_THREADS`` asks for (torch's and numpy's OpenBLAS, which read it
when the zygote loaded them), and runs the script, ``-m`` module or ``-c`` code as the interpreter's
main would (``__main__`` a fresh module, an uncaught exception's traceback from the script's frames
on). Its ``sys.executable`` is the launcher too, so torchrun's ranks and a CLI's jobs fork as well. The
launcher then stands for the child: it forwards every signal it can catch, stops itself when the
child stops, and exits as the child exited (the same status, or killed by the same signal).

A script whose first statements import a framework (transformers, Lightning, DeepSpeed, Accelerate...)
goes to a zygote of that framework: forked from the first one on the first such launch, it runs those
import statements and serves the next launches with the same statements and the same values of the
variables those frameworks read at import (``HF_*``, ``DS_*``...); what the imports set in the
environment (transformers sets ``TORCHINDUCTOR_CACHE_DIR``) is set in its children as the imports
would have set it (:func:`zygote_flavour.flavour`).

A launcher in another network namespace (a node of tests/netns.py: ``ip netns exec`` gives it a network and a
mount namespace of its own, with the same mounts but ``/sys``) is served too: its child joins both (``setns``,
as root) before it takes anything else. torchrun's ``LOGLEVEL``, read when torch's elastic package makes its
loggers, is set again in the child for each logger the zygote's imports made.

The launcher starts a plain interpreter instead (``exec``, the same pid) whenever the child could
differ from one: an option other than ``-u``, ``-B``, ``-W``, ``-X faulthandler``; another user, group,
capability set, namespace (but the network's and the mounts' above) or cgroup (a SLURM job), other mounts;
an environment that differs
from the zygote's in a variable read at import (``TORCH*``, ``OMP_*``, ``LD_*``, locale, ``PYTHON*``..., and every
variable the zygote's imports read, recorded while it imported them: torchrun's ``LOGLEVEL``, inductor's ``CXX``...);
a folder on the path that would shadow a module the zygote imported; one of the library's helper
processes, which depend on who their parent is (``PR_SET_PDEATHSIG``); no zygote listening yet; or
``UNBROKEN_TEST_PLAIN=1`` in the environment (a job whose test depends on how long its processes take to
start: a race in torch that only a slow start hides).

What differs, by design: the child's parent is the zygote, not the launcher; a signal sent to the
launcher's process group reaches the child through the launcher, not its own children (SIGKILL aside,
below); SIGKILL cannot be forwarded, so the zygote kills the child (and its process group, when the
launcher led one: a ``killpg``) when the launcher's connection closes, and every zygote has handled
that before it starts the next launch, so a test that killed a launcher and starts the next process
finds the first gone; ``conftest.py`` sends ``Popen.send_signal`` (``proc.kill()``, ``proc.terminate()``)
to the child itself, so ``proc.wait()`` returns only once the child is gone; all children of one
zygote share its hash seed (random per worker and session). A test that stops the launcher
(SIGSTOP), reads the child's ``/proc`` through ``proc.pid``, sends a catchable signal to a process
group, or kills a torchrun agent to see its ranks notice must not use it.
"""

from __future__ import annotations

import marshal
import os
import signal
import socket
import struct
import sys

# Environment variables read when torch, numpy or the interpreter start: a child whose value differs
# from the zygote's is started plainly. These are the prefixes that native code reads (OpenMP, the allocator,
# the loader: getenv in C) and those a module looks for by scanning the whole environment at import (tqdm,
# fsspec); what Python code reads by name when the zygote imports torch or a framework is recorded as it
# happens (zygote_server.reads_of_environ) and compared as well. PYTHONPATH, PYTHONHASHSEED and the emulated
# ones are checked on their own.
SENSITIVE = ("TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "GOMP_", "OPENBLAS", "NUMPY", "LD_", "PYTHON", "LANG",
             "LC_", "CUDA", "HIP_", "ROCM", "MALLOC", "GLIBC", "TQDM_", "FSSPEC_")
EMULATED = {"PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER",
            "PYTHONWARNINGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_EXTENSIONS_DIR"}
# read when used, not at import: torchrun's variables for its ranks, inductor's cache (set once it is used),
# torch.cuda's way to count devices (Lightning sets it when imported), the elastic rendezvous's store sharing
RUNTIME = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # set in the child: torch's threads and numpy's OpenBLAS
# frameworks a zygote of their own imports (when a script imports them first thing), and the variables they
# read at import, which must then be the same
FRAMEWORKS = {"transformers", "lightning", "pytorch_lightning", "deepspeed", "accelerate", "datasets", "peft"}
def framework_env(name: str) -> bool:
    """Whether the frameworks may read variable ``name`` at import: their own, and the rank (Lightning's
    ``rank_zero_only`` takes it from the environment then)."""
    return name.startswith(FRAMEWORK_ENV) or name in RANK_ENV


RANK_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "SLURM_PROCID",
            "SLURM_LOCALID", "SLURM_NODEID", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK"}
FRAMEWORK_ENV = ("HF_", "TRANSFORMERS", "TOKENIZERS", "HUGGINGFACE", "SAFETENSORS", "ACCELERATE", "DS_", "DEEPSPEED",
                 "LIGHTNING", "PL_", "WANDB", "USE_", "MLFLOW", "COMET", "TENSORBOARD", "NEPTUNE", "DISABLE_", "TQDM",
                 "NCCL", "KINETO", "DATASETS", "PEFT", "XDG_", "HOME")
# helper processes of the library that rely on their parent (PR_SET_PDEATHSIG, getppid)
PLAIN_MODULES = {"unbroken.checkpoint.background.filewriter", "unbroken.tiers.ramwriter"}
_HDR = struct.Struct("!I")


def _send(sock: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    data = marshal.dumps(obj)
    msg = _HDR.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], fds)
    else:
        sock.sendall(msg)


def _recv(sock: socket.socket, with_fds: bool = False) -> tuple[object, list[int]]:
    """One message (``None`` at end of stream) and the descriptors that came with it."""
    buf, fds = b"", []
    while len(buf) < _HDR.size or len(buf) < _HDR.size + _HDR.unpack_from(buf)[0]:
        if with_fds and not buf:
            chunk, got, _, _ = socket.recv_fds(sock, 1 << 20, 255)
            fds += got
        else:
            chunk = sock.recv(1 << 20)
        if not chunk:
            return None, fds
        buf += chunk
    return marshal.loads(buf[_HDR.size:]), fds


def identity() -> str:
    """What a forked child cannot change: credentials, capabilities, namespaces but the network's and the mounts'
    (:func:`place`), cgroup."""
    keep = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
    with open("/proc/self/status") as f:
        lines = [ln for ln in f if ln.split(":")[0] in keep]
    for ns in ("pid", "user", "uts", "ipc", "cgroup"):
        try:
            lines.append(f"{ns} {os.readlink(f'/proc/self/ns/{ns}')}\n")
        except OSError:
            pass
    with open("/proc/self/cgroup") as f:
        lines.append(f.read())
    return "".join(lines)


STAND_IN = "zygote-launch"
"""The launcher's process name (``/proc/PID/comm``) while it stands for a child."""
JOINED = ("net", "mnt")
"""The namespaces a child joins when its launcher's differ from the zygote's (``setns``, as root): a process
started by ``ip netns exec`` (a node of tests/netns.py) is in a network namespace of its own and a mount
namespace of its own whose mounts are the same but for ``/sys``."""


def place() -> dict[str, str]:
    """Where a process is that a forked child can join (:data:`JOINED`): the namespaces' ids and the mounts it
    sees, sorted, without the mounts' ids (a mount namespace's copy lists them in another order), ``/sys``
    aside (``ip netns exec`` mounts the namespace's own) and the namespaces' own folder (``/run/netns``, mounted by
    the machine's first ``ip netns add``, and its files, which come and go with the other workers' nodes)."""
    where = {}
    for ns in JOINED:
        try:
            where[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            where[ns] = ""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, fs = line.partition(" - ")
            _id, _parent, dev, root, point = fields.split()[:5]
            kind = fs.split()[0]
            if kind != "nsfs" and not (point + "/").startswith(("/sys/", "/run/netns/")):
                mounts.append(f"{dev} {root} {point} {kind} {fs.split()[1]}")
    where["mounts"] = "\n".join(sorted(mounts))
    return where


def parse(args: list[str]) -> tuple[str, str, list[str], list[str]] | str:
    """``(kind, what, options, rest)`` of an interpreter command line (kind ``"script"``, ``"-m"`` or
    ``"-c"``; ``options``: the emulated ones, ``-u``, ``-B``, ``faulthandler``, ``W:<filter>``; ``rest``: what follows
    the script, module or code), or why it is not served."""
    opts: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c"):
            if i + 1 >= len(args):
                return f"{a} without its argument"
            return a, args[i + 1], opts, args[i + 2:]
        if a[:2] in ("-m", "-c"):
            return a[:2], a[2:], opts, args[i + 1:]
        if a == "-X" and i + 1 < len(args) and args[i + 1] == "faulthandler":
            opts.append("faulthandler")
            i += 2
            continue
        if a == "-W" and i + 1 < len(args):
            opts.append("W:" + args[i + 1])
            i += 2
            continue
        if a.startswith("-W") and len(a) > 2:
            opts.append("W:" + a[2:])
            i += 1
            continue
        if a in ("-u", "-B"):
            opts.append(a)
        elif a.startswith("-") or a == "":
            return f"option {a!r}"
        else:
            return "script", a, opts, args[i + 1:]
        i += 1
    return "an interactive interpreter"


def _path0(kind: str, what: str, cwd: str) -> str:
    if kind == "script":
        return os.path.dirname(os.path.realpath(os.path.join(cwd, what)))
    return cwd if kind == "-m" else ""


# ----------------------------------------------------------------------------------------- the launcher

def launch(sock_path: str, real: str, pids: str) -> None:
    """The launcher's whole life (``<dir>/bin/python``): have the zygote start ``sys.argv[1:]`` and
    stand for the child, or become a plain interpreter."""
    args = sys.argv[1:]
    try:  # named for what it is (an exec of the real interpreter names it again): tests/netns.py lists it apart
        with open("/proc/self/comm", "w") as f:
            f.write(STAND_IN)
    except OSError:
        pass
    try:  # UNBROKEN_TEST_PLAIN=1: a job whose test depends on how long its processes take to start
        child, conn = _request(sock_path, args) if os.environ.get("UNBROKEN_TEST_PLAIN") != "1" else (0, None)
    except OSError:
        child, conn = 0, None
    if not child or conn is None:
        os.execv(real, [real, *args])
    forward = lambda sig, _frame: _kill(child, sig)  # noqa: E731
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD) or signal.getsignal(sig) == signal.SIG_IGN:
            continue
        try:
            signal.signal(sig, forward)
        except (OSError, ValueError):
            pass
    while True:
        msg, _ = _recv(conn)
        if msg is None:
            sys.stderr.write("zygote launcher: the zygote went away; the child's end is unknown\n")
            os._exit(70)
        kind, value = msg  # type: ignore[misc]
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # continued (SIGCONT) by whoever stopped the child's stand-in
        elif kind == "exit":
            try:
                os.unlink(os.path.join(pids, str(os.getpid())))
            except OSError:
                pass
            _mirror(value)


def _request(sock_path: str, args: list[str]) -> tuple[int, socket.socket | None]:
    """Ask the zygote to start ``args``: the child's pid and the connection its end comes on, or
    ``(0, None)`` for a plain start. The zygote may send the request on to another (a zygote that has
    also imported the framework the script imports: :func:`zygote_flavour.flavour`)."""
    fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if _valid(fd)]
    old_umask = os.umask(0o022)
    os.umask(old_umask)
    import resource
    limits = {r: resource.getrlimit(getattr(resource, r)) for r in dir(resource) if r.startswith("RLIMIT_")}
    req = {
        "args": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": old_umask, "limits": limits,
        "affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "ignored": [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                    and signal.getsignal(s) == signal.SIG_IGN],
        "mask": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
        "identity": identity(), "place": place(), "fds": fds, "launcher": os.getpid(),
        "executable": os.path.abspath(sys.argv[0]),
        "leader": os.getpgrp() == os.getpid(),
    }
    for _ in range(3):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock_path)
        _send(conn, req, fds)
        reply, _ = _recv(conn)
        if isinstance(reply, str):  # sent on to another zygote
            conn.close()
            sock_path = reply
            continue
        if not isinstance(reply, int) or reply <= 0:
            break
        return reply, conn
    conn.close()
    return 0, None


def _valid(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _mirror(status: int) -> None:
    """Exit as the child did."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            import resource
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child dumped its core, if any
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))
